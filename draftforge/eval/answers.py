"""Spec-Bench answer files (`draftforge eval --answers DIR`): one JSONL per method and temperature, in the layout
Spec-Bench's inference scripts write into `data/spec_bench/model_answer/` (its evaluation/eval.py,
get_model_answers), so that its evaluation/speed.py (speedup, mean accepted tokens) and evaluation/equal.py
(identical outputs) read a draftforge run.

One line per question, in the bench's order (the same in every file of a run):
  question_id     the id as the question file gives it
  category        the question's own category (speed.py folds MT-bench's eight into mt_bench itself)
  answer_id       a random hex id (Spec-Bench: a shortuuid)
  model_id        the file name without .jsonl: <target>-<method>-<dtype>-temp-<T>, as Spec-Bench's eval.sh
                  names its runs (e.g. vicuna-7b-v1.3-vanilla-float16-temp-0.0)
  tstamp          Unix time the file was written
  choices         one choice, index 0 (each question is decoded once per timed pass):
    turns           per turn, the answer text: decoded without special tokens, stripped (as eval.py does)
    decoding_steps  per turn, the target forwards that emitted tokens (DecodeStats.target_forwards): AR one per
                    token, as inference_baseline.py counts (step = new_token); draftforge's speculative methods
                    one per verification round (the prompt's prefill emits nothing here); transformers' baselines
                    (hf_assisted, hf_prompt_lookup) also count their first forward, which reads the prompt and
                    emits the first token, as inference_pld.py and inference_sps.py count (idx + 1)
    new_tokens      per turn, tokens generated, EOS included (eval.py: the output ids after the prompt)
    wall_time       per turn, seconds of the generate() call: prefill included, tokenization and detokenization
                    excluded (eval.py times forward_func alone)
    accept_lengths  per target forward, the tokens it emitted: accepted drafts + the bonus/correction token, the
                    last cut after an EOS (as inference_eagle.py and pld.py trim it); one flat list over all
                    turns, as eval.py extends it. Its sum is sum(new_tokens), its length sum(decoding_steps), its
                    mean τ (speed.py's "#Mean accepted tokens")

Which pass: `--repeats R` times every method R times; a file holds one whole timed pass, the one whose tokens/s
is the median of that method's passes at that temperature (for an even R the slower of the two middle ones), so
all turns of a question come from one pass and, for odd R, the file's tokens/s is the report's median.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from pathlib import Path

from draftforge.errors import DataError, RecipeError
from draftforge.data.prompts import Prompt, answer_text
from draftforge.fsutil import atomic_write_text, writable


def check_answers_dir(path: str | Path, say=lambda line: None) -> list[Path]:
    """Before any model loads: DIR is, or can become, a writable directory. Returns the .jsonl files already
    in it (and says so): a run replaces those it writes again, like --out's reports, and leaves the others."""
    d = Path(path).expanduser()
    if d.exists() and not d.is_dir():
        raise RecipeError(f"--answers {d} is a file; give a directory for the answer files")
    base = next((p for p in (d, *d.parents) if p.exists()), Path.cwd())  # the nearest existing folder
    if not base.is_dir():
        raise RecipeError(f"--answers {d}: {base} is a file, so the directory cannot be made")
    if not writable(base):  # tried, not read from permission bits (a read-only mount, and root, fool those)
        raise RecipeError(f"--answers {d}: cannot write in {base}")
    existing = sorted(d.glob("*.jsonl")) if d.is_dir() else []
    foreign = [p.name for p in existing if not _answer_file(p)]
    if foreign:  # a run replaces the files it writes again: only answer files may sit under their names
        raise RecipeError(f"--answers {d} holds {', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}, which "
                          "is not a Spec-Bench answer file; draftforge replaces answer files of the names it writes, "
                          "so it keeps its answers out of a directory holding other .jsonl files: choose another "
                          "--answers directory")
    if existing:
        say(f"--answers {d} already holds {len(existing)} .jsonl file(s); this run replaces those it writes again "
            "(<target>-<method>-<dtype>-temp-<T>.jsonl) and keeps the others")
    return existing


def _answer_file(path: Path) -> bool:
    """Whether `path` starts with a Spec-Bench answer line (question_id, answer_id, model_id, choices)."""
    try:
        with open(path, encoding="utf-8") as f:
            first = next((line for line in f if line.strip()), "")
        if not first:
            return True  # empty: nothing in it to lose (a method with no answers writes one)
        row = json.loads(first)
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(row, dict) and {"question_id", "answer_id", "model_id", "choices"} <= set(row)


def target_name(target) -> str:
    """The target's name in file names: the last part of its path or Hub id, [A-Za-z0-9._-] only."""
    name = Path(str(target).rstrip("/")).name or "target"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name)


def model_id(name: str, method: str, dtype: str, temperature: float) -> str:
    return f"{name}-{method}-{dtype}-temp-{float(temperature)}"


def accept_lengths(stats) -> list[int]:
    """Tokens emitted by each target forward of one turn (sum = stats.new_tokens): accepted drafts + 1, the last
    round cut after an EOS (the engine counts drafts up to and including the EOS as accepted)."""
    from draftforge.eval.metrics import emitted_per_round

    return emitted_per_round(stats)


def median_repeat(records) -> int:
    """The repeat whose pass tokens/s (its new tokens / its generate() seconds) is the median of the
    records' repeats; for an even count the slower of the two middle passes."""
    tps = {}
    for rep in sorted({r.repeat for r in records}):
        mine = [r for r in records if r.repeat == rep]
        secs = sum(r.stats.total_time_s for r in mine)
        tps[rep] = sum(r.stats.new_tokens for r in mine) / secs if secs > 0 else 0.0
    order = sorted(tps, key=lambda rep: (tps[rep], rep))
    return order[(len(order) - 1) // 2]


def answer_line(prompt: Prompt, turn_records, tokenizer, mid: str) -> dict:
    """One question's Spec-Bench record from its turns' RunRecords (one pass)."""
    recs = sorted(turn_records, key=lambda r: r.turn)
    choice = {"index": 0,
              "turns": [answer_text(tokenizer, r.tokens) for r in recs],
              "decoding_steps": [r.stats.target_forwards for r in recs],
              "new_tokens": [r.stats.new_tokens for r in recs],
              "wall_time": [r.stats.total_time_s for r in recs],
              "accept_lengths": [n for r in recs for n in accept_lengths(r.stats)]}
    qid = prompt.question_id if prompt.question_id is not None else prompt.prompt_id
    return {"question_id": qid, "category": prompt.category, "answer_id": uuid.uuid4().hex, "model_id": mid,
            "choices": [choice], "tstamp": time.time()}


def write_answers(out_dir, records, prompts: list[Prompt], tokenizer, *, name: str, dtype: str,
                  say=lambda line: None) -> dict[str, dict]:
    """One file per (method, temperature) of `records` (metrics.RunRecord); returns, per "method@T", its path,
    model_id, the repeat written and the number of questions. `say` hears about each file it replaces."""
    out, written = Path(out_dir).expanduser(), {}
    for method, temp in dict.fromkeys((r.method, r.temperature) for r in records):
        mine = [r for r in records if r.method == method and r.temperature == temp]
        rep = median_repeat(mine)
        by_prompt: dict[str, list] = {}
        for r in mine:
            if r.repeat == rep:
                by_prompt.setdefault(r.prompt_id, []).append(r)
        mid = model_id(name, method, dtype, temp)
        lines = [answer_line(p, by_prompt[p.prompt_id], tokenizer, mid) for p in prompts if p.prompt_id in by_prompt]
        path = out / f"{mid}.jsonl"
        if path.exists():
            say(f"--answers: replacing {path}")
        atomic_write_text(path, "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines))
        written[f"{method}@{temp:g}"] = {"path": str(path), "model_id": mid, "repeat": rep, "questions": len(lines)}
    say(f"Spec-Bench answer files ({len(written)}) in {out}")
    return written


def require_tokenizer(tokenizer, target) -> None:
    """Answer files hold each answer's text: a target without a tokenizer cannot write them."""
    if tokenizer is None:
        raise DataError(f"--answers writes each answer's text, but the target {target} has no tokenizer; save one "
                        "with the target, or leave out --answers")
