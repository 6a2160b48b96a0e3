"""`draftforge generate`: a target's own responses as token rows (format: tokens) for SFT / self-distillation.

Chat targets answer prompts (a JSONL of `messages` / `prompt`, encoded exactly as `draftforge eval`
encodes them); base targets follow the EESD / LLM-QAT recipe (EESD §3.2, docs/methods/eesd.md §3): start
from one random token, decode greedily for the first 3-5 tokens, then sample. Each prompt is answered
once per temperature (0 = greedy), so one file mixes greedy and sampled answers.

Rows {"input_ids", "prompt_len", "prompt_id", "temperature"} are appended to a JSONL file one batch at
a time. A killed run resumes: the rows already written are kept (a torn last line is dropped) and only
the missing ones are generated. A batch is always the same prompts with the same seed, so a resumed
file equals an uninterrupted one. Before the first row, `ROWS.meta.json` records the tokenizer's and the
target's fingerprints (data/provenance.py): readers refuse the rows for another tokenizer, and a resume
with another target or tokenizer is refused before anything is appended.
Legend: B = batch, P = padded prompt length, N = new tokens.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from draftforge.argcheck import repeated
from draftforge.errors import DataError

GREEDY_PREFIX = (3, 5)  # EESD §3.2: random first token, greedy for 3-5 tokens, then sample


@dataclass
class Job:
    """One prompt to answer: its id and the ids the target reads (greedy_prefix > 0 only for base targets)."""

    prompt_id: str
    input_ids: list[int]
    greedy_prefix: int = 0


@dataclass
class GenStats:
    rows: int = 0
    skipped: int = 0
    new_tokens: int = 0
    ended_eos: int = 0
    seconds: float = 0.0


def chat_jobs(prompt_file, tokenizer, context: int, max_new_tokens: int, num_prompts=None) -> list[Job]:
    """Prompts from a JSONL file through the chat template; DataError for a prompt longer than the context or an id
    given twice (a resumed run knows its answered prompts by id)."""
    from draftforge.data.prompts import load_prompts

    prompts = load_prompts(prompt_file, tokenizer, num_prompts=num_prompts, context_length=context,
                           max_new_tokens=max_new_tokens)
    return [Job(p.prompt_id, p.input_ids) for p in prompts]


def random_start_jobs(n: int, vocab_size: int, seed: int, skip_ids=()) -> list[Job]:
    """EESD §3.2 for base targets: n prompts of one random token each, greedy for the first 3-5 tokens."""
    if n <= 0:
        raise DataError(f"--random-starts must be positive, got {n}")
    rng = random.Random(seed)
    skip = set(skip_ids)
    jobs = []
    for i in range(n):
        token = rng.randrange(vocab_size)
        while token in skip:
            token = rng.randrange(vocab_size)
        jobs.append(Job(f"random-{i:06d}", [token], rng.randint(*GREEDY_PREFIX)))
    return jobs


def read_rows(path: Path, cut_torn: bool = False) -> dict[tuple[str, float], list[int]]:
    """(prompt_id, temperature) -> the prompt's ids, for every row in the file. A torn last line (a killed
    write) is cut off only with `cut_torn` (the caller knows the file is generate's own: its sidecar says so);
    otherwise it is an error, like any line that is not a row: the file may be the user's."""
    done: dict[tuple[str, float], list[int]] = {}
    if not path.is_file():
        return done
    data = path.read_bytes()
    good = 0  # byte offset after the last complete, parseable line
    for line in data.splitlines(keepends=True):
        try:
            row = json.loads(line) if line.endswith(b"\n") else None
        except ValueError:
            row = None
        if row is None:
            if data[good + len(line):].strip():
                raise DataError(f"{path}: a malformed line at byte {good} is not the last one; the file is not "
                                "one this command wrote (move it away or pass another --out)")
            if not cut_torn:
                raise DataError(f"{path}: its last line is not a complete row and the file has no sidecar of "
                                f"`draftforge generate` ({path.name}.meta.json), so it is not cut: it may be yours "
                                "(move it away or pass another --out)")
            break
        if not isinstance(row, dict) or "prompt_id" not in row or "temperature" not in row:
            raise DataError(f"{path}: rows lack 'prompt_id'/'temperature'; it is not a `draftforge generate` file")
        ids, n = row.get("input_ids"), row.get("prompt_len")
        done[(str(row["prompt_id"]), float(row["temperature"]))] = (
            list(ids[:n]) if isinstance(ids, list) and isinstance(n, int) else [])
        good += len(line)
    if good < len(data):
        with open(path, "r+b") as f:
            f.truncate(good)
    return done


def read_done(path: Path, cut_torn: bool = False) -> set[tuple[str, float]]:
    """(prompt_id, temperature) pairs already in the file (read_rows)."""
    return set(read_rows(path, cut_torn))


def eos_ids(model, tokenizer) -> list[int]:
    eos = getattr(model.generation_config, "eos_token_id", None)
    if eos is None:
        eos = tokenizer.eos_token_id if tokenizer is not None else None
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


def cut_at_eos(new_ids: list[int], eos: list[int]) -> tuple[list[int], bool]:
    """The emitted ids up to and including the first EOS (padding after it dropped); whether EOS came."""
    for i, t in enumerate(new_ids):
        if t in eos:
            return new_ids[: i + 1], True
    return new_ids, False


def _generate(model, prompts_BP, mask_BP, n_new: int, temperature: float, eos, pad_id):
    from transformers import GenerationConfig

    sample = temperature > 0
    cfg = GenerationConfig(max_new_tokens=n_new, do_sample=sample, temperature=temperature if sample else None,
                           top_k=0 if sample else None, top_p=1.0 if sample else None,
                           eos_token_id=eos or None, pad_token_id=pad_id)
    # generate() fills every setting a call leaves unset from the model's own generation config, so a target that
    # ships repetition_penalty (Qwen2.5-Instruct: 1.05), no_repeat_ngram_size or min_p bent its rows away from its
    # own distribution, the one speculative decoding verifies against: the call sees the model's token ids only
    own = model.generation_config
    model.generation_config = GenerationConfig(bos_token_id=own.bos_token_id, eos_token_id=own.eos_token_id,
                                               pad_token_id=own.pad_token_id)
    try:
        with torch.no_grad():
            out_BT = model.generate(input_ids=prompts_BP, attention_mask=mask_BP, generation_config=cfg)
    finally:
        model.generation_config = own
    return out_BT[:, prompts_BP.shape[1]:]


def _left_pad(seqs: list[list[int]], pad_id: int):
    width = max(len(s) for s in seqs)
    ids_BP = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask_BP = torch.zeros((len(seqs), width), dtype=torch.long)
    for b, s in enumerate(seqs):
        ids_BP[b, width - len(s):] = torch.tensor(s)
        mask_BP[b, width - len(s):] = 1
    return ids_BP, mask_BP


def answer_batch(model, jobs: list[Job], temperature: float, max_new_tokens: int, eos, pad_id) -> list[list[int]]:
    """The target's answer to each job (EOS included, nothing after it); at T>0 base jobs decode their
    greedy prefix first (one length per batch: the longest of its jobs, so a batch stays one generate())."""
    prefix = max(j.greedy_prefix for j in jobs) if temperature > 0 else 0
    prefix = min(prefix, max_new_tokens)
    seqs = [list(j.input_ids) for j in jobs]
    if prefix:  # EESD §3.2: the first tokens greedily (all jobs of a batch share the prefix length)
        ids_BP, mask_BP = _left_pad(seqs, pad_id)
        head_BN = _generate(model, ids_BP, mask_BP, prefix, 0.0, eos, pad_id).tolist()
        seqs = [s + h for s, h in zip(seqs, head_BN)]
    ids_BP, mask_BP = _left_pad(seqs, pad_id)
    rest = max_new_tokens - prefix
    new_BN = _generate(model, ids_BP, mask_BP, rest, temperature, eos, pad_id).tolist() if rest else [[]] * len(jobs)
    answers = []
    for job, seq, new in zip(jobs, seqs, new_BN):
        answers.append(seq[len(job.input_ids):] + new)
    return answers


def row_settings(max_new_tokens: int, seed: int, batch_size: int, dtype: str) -> dict:
    """What shapes a row besides its prompt and temperature: the length cap, the per-batch sampling seeds (seed
    and batch size decide them) and the precision."""
    return {"max_new_tokens": int(max_new_tokens), "seed": int(seed), "batch_size": int(batch_size),
            "dtype": str(dtype)}


def rows_problem(out: Path, settings: dict, prompts: Path | None = None) -> str | None:
    """Why `out` cannot take this run's rows (checked before a model loads), else None: it is the prompts file;
    it holds something that is not generate's rows; or its sidecar records other settings (named, old -> new).
    A sidecar written before settings were recorded cannot be compared: its rows are resumed as they are."""
    from draftforge.data.provenance import foreign_sidecar, read_sidecar

    out = Path(out)
    if prompts is not None and Path(prompts).exists() and out.exists() and out.resolve() == Path(prompts).resolve():
        return f"--out {out} is the --prompts file; the rows go to a file of their own"
    if not out.is_file() or out.stat().st_size == 0:
        theirs = foreign_sidecar(out, WRITTEN_BY)  # no rows yet: the record generate writes first must be free
        if theirs is not None:
            return (f"{theirs} is not a record `draftforge generate` wrote, and the rows' record goes there; "
                    "move it, or pass another --out")
        return None
    try:
        record = read_sidecar(out)
    except DataError as e:
        return str(e)
    if record is None or record.get("written_by") != WRITTEN_BY:
        try:  # rows from before sidecars, or from outside: resumed only if every line is a row (nothing is cut)
            read_rows(out, cut_torn=False)
        except DataError as e:
            return str(e)
        return None
    old = record.get("settings")
    if not isinstance(old, dict):
        return None
    differ = [f"{k} {old.get(k)} -> {v}" for k, v in settings.items() if k in old and old[k] != v]
    if differ:
        return (f"{out} holds rows made with other settings ({'; '.join(differ)}); a resume must use the same "
                "(they decide the rows), or pass another --out")
    return None


def jobs_fingerprint(jobs: list[Job]) -> str:
    """sha256 of the job list the batches are planned over (plan_batches): a resume over another list batches, and
    so samples, the remaining rows otherwise than an uninterrupted run of either list."""
    import hashlib

    text = json.dumps(sorted([j.prompt_id, list(j.input_ids), j.greedy_prefix] for j in jobs))
    return hashlib.sha256(text.encode()).hexdigest()


def batch_seed(seed: int, batch_index: int, temperature: float) -> int:
    return (seed * 1_000_003 + batch_index * 7919 + int(round(temperature * 1000))) % (2**31)


def plan_batches(jobs: list[Job], batch_size: int) -> list[list[Job]]:
    """Fixed batches of similar lengths (less padding); the same jobs give the same batches on resume."""
    order = sorted(jobs, key=lambda j: (len(j.input_ids), j.prompt_id))
    return [order[i:i + batch_size] for i in range(0, len(order), batch_size)]


def check_settings(temperatures, max_new_tokens: int, batch_size: int) -> list[float]:
    """The temperatures as floats; DataError for settings no run can use (checked before a model loads)."""
    if max_new_tokens <= 0:
        raise DataError(f"--max-new-tokens must be positive, got {max_new_tokens}")
    if batch_size <= 0:
        raise DataError(f"--batch-size must be positive, got {batch_size}")
    temps = [float(t) for t in temperatures]
    if not temps or any(not 0 <= t < math.inf for t in temps):  # NaN too
        raise DataError(f"--temperature takes finite values >= 0 (0 = greedy), got {list(temperatures)}")
    twice = repeated(temps)
    if twice is not None:  # its rows were written twice (the rows already there are read once, before the loop)
        raise DataError(f"--temperature names {twice} twice; give each temperature once")
    return temps


WRITTEN_BY = "draftforge generate"


def generate_rows(model, tokenizer, jobs: list[Job], out: Path, *, temperatures=(0.0, 1.0), max_new_tokens=256,
                  batch_size=8, seed=0, progress=None, target=None, dtype: str | None = None) -> GenStats:
    """Answer every job at every temperature and append the rows to `out`, skipping rows already there.
    `target` (path or id) is what the sidecar names as the rows' maker (default: the model's name_or_path).
    `progress(new_rows, tokens_per_s, rows_there)` is called after each batch that wrote rows: the rows it
    wrote, the run's rate so far, and the rows of this job list now in the file (the kept ones included).
    The settings that shape a row (max_new_tokens, seed, batch_size, dtype: the model's unless given) go into
    the sidecar; a resume with others, or with a prompt whose tokens changed, is refused (rows_problem)."""
    from draftforge.fsutil import OutputLock

    temps = check_settings(temperatures, max_new_tokens, batch_size)
    out = Path(out)
    settings = row_settings(max_new_tokens, seed, batch_size, dtype or str(model.dtype).removeprefix("torch."))
    problem = rows_problem(out, settings)
    if problem:
        raise DataError(problem)
    out.parent.mkdir(parents=True, exist_ok=True)
    with OutputLock(out, WRITTEN_BY):
        return _generate_rows(model, tokenizer, jobs, out, temps, max_new_tokens, batch_size, seed, progress,
                              target, settings)


def _generate_rows(model, tokenizer, jobs, out: Path, temps, max_new_tokens, batch_size, seed, progress, target,
                   settings) -> GenStats:
    from draftforge.data.provenance import notice, open_rows_file, read_sidecar, rows_record, write_sidecar
    from draftforge.runtime import device_name, mixed_devices_text, other_devices

    target = target or getattr(model.config, "name_or_path", None)
    jobs_sha, device = jobs_fingerprint(jobs), device_name(model.device)
    open_rows_file(out, {**rows_record(tokenizer, model, target, WRITTEN_BY), "settings": settings,
                         "jobs_sha256": jobs_sha, "devices": [device]})
    record = read_sidecar(out) or {}
    ours = record.get("written_by") == WRITTEN_BY
    kept = read_rows(out, cut_torn=ours)
    changed = [job.prompt_id for job in jobs for temp in temps  # our own rows only: outside ones are as they are
               if ours and kept.get((job.prompt_id, temp)) not in (None, [], list(job.input_ids))]
    if changed:
        raise DataError(f"{out}: the row of prompt {changed[0]!r} (and {len(changed) - 1} more) was answered to "
                        "other prompt tokens than this run's (the prompt's text, or its chat template, changed); "
                        "pass another --out, or the prompts that file was made from")
    done = set(kept)
    eos = eos_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else (eos or [0])[0]
    stats, t0 = GenStats(), time.perf_counter()
    stats.skipped = sum((job.prompt_id, temp) in done for temp in temps for job in jobs)
    if record.get("jobs_sha256", jobs_sha) != jobs_sha and 0 < stats.skipped < len(jobs) * len(temps):
        notice([str(out)], "it was started on another prompt list (--num-prompts, --random-starts or the prompts "
                           "changed); its rows are kept and the rest are batched over this list, so the file equals "
                           "no single uninterrupted run (each row is still the target's own answer); pass another "
                           "--out for rows that one run reproduces")
    if "devices" in record and stats.skipped < len(jobs) * len(temps):  # a sidecar from before: nothing to compare
        others = other_devices(record["devices"], device)
        if others:
            notice([str(out)], mixed_devices_text(others, device))
            write_sidecar(out, {**record, "devices": [*record["devices"], device]})
    model.eval()
    for temp in temps:
        for b, batch in enumerate(plan_batches(jobs, batch_size)):
            missing = [j for j in batch if (j.prompt_id, temp) not in done]
            if not missing:
                continue
            torch.manual_seed(batch_seed(seed, b, temp))  # the whole batch again: same rows as an unbroken run
            answers = answer_batch(model, batch, temp, max_new_tokens, eos, pad_id)
            lines = []
            for job, new in zip(batch, answers):
                if (job.prompt_id, temp) in done:
                    continue
                new, ended = cut_at_eos(new, eos)
                stats.rows, stats.new_tokens, stats.ended_eos = (stats.rows + 1, stats.new_tokens + len(new),
                                                                 stats.ended_eos + ended)
                lines.append(json.dumps({"input_ids": job.input_ids + new, "prompt_len": len(job.input_ids),
                                         "prompt_id": job.prompt_id, "temperature": temp}) + "\n")
            with open(out, "a", encoding="utf-8") as f:
                f.write("".join(lines))
                f.flush()
            if progress is not None:
                progress(len(missing), stats.new_tokens / max(time.perf_counter() - t0, 1e-9),
                         stats.skipped + stats.rows)
    stats.seconds = time.perf_counter() - t0
    return stats


def summary_lines(stats: GenStats, out: Path, total: int) -> list[str]:
    per = stats.new_tokens / stats.rows if stats.rows else 0.0
    return [f"generate: wrote {stats.rows} rows to {out} (skipped {stats.skipped} already there; {total} in all)",
            f"  new tokens: {stats.new_tokens:,} ({per:.1f} per row, {stats.ended_eos} ended with EOS) in "
            f"{stats.seconds:.1f} s = {stats.new_tokens / max(stats.seconds, 1e-9):.1f} tokens/s"]
