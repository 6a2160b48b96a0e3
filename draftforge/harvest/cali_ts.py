"""`draftforge harvest theta`: χ labels and hidden states for the Cali-TS θ predictor (EESD §3.3).

Why these rows and positions: docs/methods/cali-ts.md §4-§5.

Teacher-forced passes of the frozen target and drafter over held-out sequences (token rows, or text
tokenized with the target's tokenizer; `--generate N` first lets the target continue each greedily, so
the labelled part is the target's own output). Both are loaded as the harness loads them, so the drafter
may be any kind `eval` takes, an EESD export too (its target's layers 1..N, then the exit head; a reduced
head's argmax mapped to target ids as drafting does). For an anchor c (the last committed token s_c) and
a draft offset i = 1..max_offset, one feature row holds what Cali-TS reads at decode time (models/cali_ts.py
says why these positions):
  h_target  the target's hidden state at c-1 (the row that emitted s_c);
  h_draft   the drafter's hidden state at p, the stop rule's hidden_D after draft i: p = c+i-1 (after s_≤p:
            the state that chooses draft i), or p = c+i for an early-exit drafter (after consuming draft i);
  offset    i;   label  χ = 1[drafter argmax at p == target argmax at p] (draft i, or for EESD draft i+1,
            accepted given the earlier drafts were);
  sequence  the sequence's index in the harvest (the theta task holds out whole sequences by it).
Rows go through `datasets` into shards of `--shard-size` sequences under OUT/shards/; OUT/harvest.json
records the pair (fingerprints, drafter kind), the settings and the shards done, so a killed run resumes
where it stopped.

Legend: S sequence length, T target width, D drafter width, R rows.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import sys
from dataclasses import MISSING, dataclass
from pathlib import Path

import torch

from draftforge.errors import DataError, DraftforgeError
from draftforge.fsutil import atomic_write_text, foreign_dir_problem, sha256_file, temp_dir_beside
from draftforge.harvest.job import HarvestJob
from draftforge.options import add_flags, non_negative_int, option, positive_int
from draftforge.runtime import announce, device_name, mixed_devices_text, other_devices, resolve_dtype

MANIFEST = "harvest.json"
KIND = "theta-harvest"  # manifests before 2026-11-28 have no kind
SETTING_KEYS = ("target_fingerprint", "drafter_fingerprint", "max_offset", "anchor_stride", "max_len", "generate",
                "shard_size", "sources", "drafter_kind", "exit_after_layer", "tokenizer_fingerprint", "dtype",
                "max_sequences", "sources_sha256")
# absent from older manifests (their fingerprints still bind them)
LATER_KEYS = ("drafter_kind", "exit_after_layer", "tokenizer_fingerprint", "dtype", "max_sequences", "sources_sha256")
ROWS_FIX = "regenerate the rows with this target, or pass --target {theirs}"
TRAIN_FIX = "harvest again with the target you train for, or point model.target / model.tokenizer at {theirs}"


def check_source(src) -> None:
    if not Path(src).is_file():
        raise DataError(f"harvest source {src} {'is a directory' if Path(src).is_dir() else 'does not exist'} "
                        "(give a JSONL file of token rows or text rows)")


def read_sequences(sources: list[str], tokenizer, max_sequences: int | None) -> list[tuple[list[int], int]]:
    """(ids, first labelled position) per row: token rows use their prompt_len / loss_mask, text starts at 1.
    A file of token rows is checked against the target's tokenizer (its sidecar) at its first token row."""
    from draftforge.data.provenance import check_row_files
    from draftforge.data.sources import iter_jsonl, normalize_tokens

    out = []
    for src in sources:
        check_source(src)
        checked = False  # text rows need no check: the target's own tokenizer reads them
        for line_no, row in iter_jsonl(src):
            if not isinstance(row, dict):
                raise DataError(f"{src}:{line_no}: a harvest row is a JSON object with 'input_ids' (token rows) or "
                                f"'text', not a {type(row).__name__}")
            if "input_ids" in row:
                if not checked:
                    check_row_files([src], tokenizer, ROWS_FIX)
                    checked = True
                normalize_tokens(row, f"{src}:{line_no}")  # DataError for a malformed row
                ids, start = row["input_ids"], _labelled_start(row)
            elif isinstance(row.get("text"), str) and tokenizer is not None:
                ids, start = tokenizer(row["text"])["input_ids"], 1
            else:
                raise DataError(f"{src}:{line_no}: a harvest row needs 'input_ids' (token rows) or 'text' "
                                "(with a target that has a tokenizer)")
            if len(ids) >= 2:
                out.append((list(ids), max(1, int(start))))
            if max_sequences is not None and len(out) >= max_sequences:
                return out
    return out


def _labelled_start(row: dict) -> int:
    """The first position of a token row's labelled part (prompt_len, else the first loss_mask 1, else 1)."""
    if "prompt_len" in row:
        return row["prompt_len"]
    mask = row.get("loss_mask") or [1]
    return mask.index(1) if 1 in mask else len(row["input_ids"])


@torch.inference_mode()
def sequence_rows(target, drafter, ids: list[int], start: int, max_offset: int, stride: int) -> dict:
    """Feature rows of one sequence as column lists (empty lists if it is too short); `target` and `drafter`
    are the harness's (load_target / load_drafter), so any drafter kind gives its decode-time rows."""
    ids_1S = torch.tensor([ids], device=target.device)
    t_out = target.model(input_ids=ids_1S, output_hidden_states=True)
    h_target_ST = t_out.hidden_states[-1][0].float()
    target_tok_S = t_out.logits[0, :, : target.vocab_size].argmax(-1)
    draft_logits_SV, h_draft_SD = drafter.teacher_forced(ids_1S)
    agree_S = (draft_logits_SV.argmax(-1).to(target.device) == target_tok_S).long().tolist()
    lag = int(drafter.hidden_after_token)  # an early-exit drafter's hidden_D at offset i sits one position on
    cols = {"h_target": [], "h_draft": [], "offset": [], "label": []}
    n = len(ids)
    for c in range(max(1, start), n, stride):
        for i in range(1, max_offset + 1):
            p = c + i - 1 + lag
            if p >= n:
                break
            cols["h_target"].append(h_target_ST[c - 1])
            cols["h_draft"].append(h_draft_SD[p])
            cols["offset"].append(i)
            cols["label"].append(agree_S[p])
    return cols


def _to_dataset(cols: dict):
    import datasets

    datasets.disable_progress_bars()  # one bar (sequences) is enough
    if not cols["label"]:
        return None
    return datasets.Dataset.from_dict({
        "h_target": torch.stack(cols["h_target"]).float().cpu().numpy(),  # numpy has no bf16
        "h_draft": torch.stack(cols["h_draft"]).float().cpu().numpy(),
        "offset": cols["offset"], "label": cols["label"],
        **({"sequence": cols["sequence"]} if "sequence" in cols else {})})


def _load_models(target_path, drafter_path, device, allow_vocab_mismatch=False, dtype=None):
    """The harness's target and drafter (any kind: HF causal LM, Mamba, an EESD export on this target)."""
    from draftforge.decode import load_drafter, load_target

    target = load_target(target_path, device=device, dtype=dtype)
    drafter = load_drafter(drafter_path, target, device=device, allow_vocab_mismatch=allow_vocab_mismatch,
                           cuda_graphs="off", dtype=dtype)  # never drafts here: one teacher-forced pass per sequence
    return target, drafter


def _continue(target, ids: list[int], n: int) -> list[int]:
    """The target's own greedy continuation of `ids` by n tokens (the held-out, target-generated text)."""
    ids_1S = torch.tensor([ids], device=target.device)
    out = target.model.generate(ids_1S, attention_mask=torch.ones_like(ids_1S), max_new_tokens=n, do_sample=False,
                                pad_token_id=0)
    return out[0].tolist()


def _check_out(out: Path, resume: bool, overwrite: bool) -> dict | None:
    """What --out holds, checked before any model loads: nothing, an empty directory (None), or a θ harvest that
    --resume continues or --overwrite replaces (its manifest). Anything else is refused, whatever the flags."""
    manifest_path = out / MANIFEST
    if not manifest_path.is_file():
        problem = foreign_dir_problem(out, MANIFEST, "a θ harvest")
        if problem:
            raise DataError(problem)
        return None
    try:
        old = json.loads(manifest_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{manifest_path}: not readable JSON ({e}); harvest into a new --out") from None
    if not isinstance(old, dict) or old.get("kind", KIND) != KIND:  # a logits cache: --overwrite would orphan it
        raise DataError(f"--out {out} holds a {old.get('kind') if isinstance(old, dict) else 'other file'}, not a θ "
                        "harvest; choose another --out")
    if not resume and not overwrite:
        raise DraftforgeError(f"{out} already holds a harvest; pass --resume to continue it or --overwrite to start "
                              "again")
    return old


OWN_SHARD = re.compile(r"shard-\d{5}")
OWN_LEFTOVER = re.compile(r"\.shard-\d{5}\.tmp-.+")  # what a save killed before its rename leaves (temp_dir_beside)


def _remove_own_shards(shards: Path, everything: bool) -> None:
    """Delete what the harvest wrote under OUT/shards (every shard-NNNNN with `everything`, and always a killed
    save's leftovers), never another file someone put there."""
    if not shards.is_dir():
        return
    for path in shards.iterdir():
        if path.is_dir() and (OWN_LEFTOVER.fullmatch(path.name) or everything and OWN_SHARD.fullmatch(path.name)):
            shutil.rmtree(path)


def _check_resume(manifest_path: Path, settings: dict, resume: bool, overwrite: bool) -> dict:
    """The manifest to continue from (fresh if none); refuses to mix settings or clobber a harvest silently."""
    old = _check_out(manifest_path.parent, resume, overwrite)
    if old is None:
        return {**settings, "shards": {}}
    if overwrite:
        _remove_own_shards(manifest_path.parent / "shards", everything=True)
        return {**settings, "shards": {}}
    def same(k):
        if k == "sources":  # the same files, however they are spelled
            return [str(Path(p).resolve()) for p in old.get(k) or []] == [str(Path(p).resolve()) for p in settings[k]]
        return old.get(k) == settings.get(k)

    changed = [k for k in SETTING_KEYS if (k in old or k not in LATER_KEYS) and not same(k)]
    if changed:
        said = "; ".join(f"{k} {old.get(k)} -> {settings.get(k)}" for k in changed)
        raise DraftforgeError(f"--resume: the harvest in {manifest_path.parent} was made with other settings "
                              f"({said}); use the same ones, or --overwrite")
    return old


def harvest_theta(target_path, drafter_path, sources: list[str], out_dir, **settings) -> dict:
    """Write the feature rows (resumable); returns the manifest (settings: `_harvest_theta`'s). One harvest per
    --out at a time (two rewrote each other's manifest)."""
    from draftforge.fsutil import shared_lock

    with shared_lock(out_dir, "draftforge harvest theta"):
        return _harvest_theta(target_path, drafter_path, sources, out_dir, **settings)


def _harvest_theta(target_path, drafter_path, sources: list[str], out_dir, *, max_offset=16, anchor_stride=8,
                   max_len=512, generate=0, max_sequences=None, shard_size=64, resume=False, overwrite=False,
                   device="cpu", allow_vocab_mismatch=False, progress=True, dtype="auto") -> dict:
    """Write the feature rows (resumable); returns the manifest. `dtype`: as `draftforge eval --dtype`."""
    from tqdm.auto import tqdm

    from draftforge.data.provenance import tokenizer_identity
    from draftforge.models.cali_ts import drafter_identity, hidden_size, model_fingerprint

    for name, value in (("max_offset", max_offset), ("anchor_stride", anchor_stride), ("shard_size", shard_size),
                        ("max_len", max_len)):
        if not isinstance(value, int) or value < 1:
            raise DraftforgeError(f"--{name.replace('_', '-')} must be a positive integer, got {value!r}")
    if not isinstance(generate, int) or not 0 <= generate < max_len:
        raise DraftforgeError(f"--generate must be in [0, --max-len) = [0, {max_len}), got {generate!r}")
    if resume and overwrite:  # it replaced the harvest silently under the new settings
        raise DraftforgeError("--resume continues a harvest and --overwrite replaces it: pass one of them")
    for src in sources:  # a missing file was found only after both models had loaded
        check_source(src)
    out_dir = Path(out_dir)
    _check_out(out_dir, resume, overwrite)  # before the models load
    choice = resolve_dtype(dtype, device)
    announce(choice, "target and drafter")
    target, drafter = _load_models(target_path, drafter_path, device, allow_vocab_mismatch, choice.torch_dtype)
    ctx = target.max_context
    if ctx is not None and max_len > ctx:  # positions past the context are undefined for the target: wrong labels
        if generate >= ctx:
            raise DraftforgeError(f"--generate {generate} leaves no prompt within the target's context of {ctx} "
                                  "tokens; give a smaller --generate")
        print(f"[draftforge] harvest θ: --max-len {max_len} is past the target's context of {ctx} tokens: "
              f"sequences are cut at {ctx}", file=sys.stderr)
        max_len = ctx
    settings = {"kind": KIND, "dtype": choice.name, "target": str(target_path), "drafter": str(drafter_path),
                "sources": [str(s) for s in sources],
                "target_fingerprint": model_fingerprint(target.model), "target_dim": hidden_size(target.model),
                **drafter_identity(drafter), "max_offset": max_offset, "anchor_stride": anchor_stride,
                "max_len": max_len, "generate": generate, "shard_size": shard_size, "max_sequences": max_sequences,
                "sources_sha256": [sha256_file(Path(s)) if Path(s).is_file() else None for s in sources],
                **tokenizer_identity(target.tokenizer)}
    seqs = read_sequences(sources, target.tokenizer, max_sequences)  # first: --overwrite deletes shards
    if not seqs:
        raise DataError(f"no usable sequences in {', '.join(map(str, sources))} (each needs at least 2 tokens)")
    manifest = _check_resume(out_dir / MANIFEST, settings, resume, overwrite)
    _remove_own_shards(out_dir / "shards", everything=False)
    # written before the first shard: a run killed while saving it is a θ harvest --resume continues, not a
    # folder of someone else's files
    atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    broken = [k for k in manifest["shards"] if manifest["shards"][k]["rows"] and not _readable(out_dir, int(k))]
    for k in broken:  # a shard is saved whole and renamed: one that cannot be read was damaged since
        del manifest["shards"][k]
    if broken:
        print(f"[draftforge] harvest θ: {len(broken)} kept shard(s) could not be read (shard-{int(broken[0]):05d}"
              f"{' ...' if len(broken) > 1 else ''}): harvested again", file=sys.stderr)
    n_shards = (len(seqs) + shard_size - 1) // shard_size
    kept = sum(len(seqs[s * shard_size: (s + 1) * shard_size]) for s in range(n_shards) if str(s) in manifest["shards"])
    if kept:
        print(f"[draftforge] harvest θ: {kept} of {len(seqs)} sequences are in shards an earlier run wrote: kept",
              file=sys.stderr)
    here = device_name(device)
    others = other_devices([manifest["shards"][k].get("device") for k in manifest["shards"]], here)
    if others and kept < len(seqs):
        print(f"[draftforge] harvest θ: notice: {mixed_devices_text(others, here)}", file=sys.stderr)
    # the bar starts at the kept sequences, so its rate and ETA count only the ones harvested now
    bar = tqdm(total=len(seqs), initial=kept, desc="harvest θ rows", unit="seq", disable=not progress)
    for shard in range(n_shards):
        chunk = seqs[shard * shard_size: (shard + 1) * shard_size]
        if str(shard) in manifest["shards"]:
            continue
        cols = {"h_target": [], "h_draft": [], "offset": [], "label": [], "sequence": []}
        for j, (ids, start) in enumerate(chunk):
            if generate:
                prompt = ids[: max_len - generate]
                start, ids = len(prompt), _continue(target, prompt, generate)
            ids = ids[:max_len]
            rows = sequence_rows(target, drafter, ids, start, max_offset, anchor_stride)
            for k, v in rows.items():
                cols[k] += v
            cols["sequence"] += [shard * shard_size + j] * len(rows["label"])  # the theta task splits by it
            bar.update(1)
        manifest["shards"][str(shard)] = {**_write_shard(out_dir, shard, cols), "device": here}
        atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    bar.close()
    return finish_manifest(out_dir, manifest)


def _readable(out_dir: Path, shard: int) -> bool:
    import datasets

    try:
        datasets.load_from_disk(str(out_dir / "shards" / f"shard-{shard:05d}"))
        return True
    except Exception:  # datasets and pyarrow raise several kinds for a damaged shard
        return False


def _write_shard(out_dir: Path, shard: int, cols: dict) -> dict:
    """One shard saved atomically (temp dir, then rename); its row count and label sum."""
    ds = _to_dataset(cols)
    if ds is None:
        return {"rows": 0, "positives": 0}
    final = out_dir / "shards" / f"shard-{shard:05d}"
    tmp = temp_dir_beside(final)
    ds.save_to_disk(str(tmp))
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return {"rows": len(ds), "positives": int(sum(cols["label"]))}


def finish_manifest(out_dir: Path, manifest: dict) -> dict:
    rows = sum(s["rows"] for s in manifest["shards"].values())
    positives = sum(s["positives"] for s in manifest["shards"].values())
    manifest.update(rows=rows, mean_label=positives / rows if rows else None)
    atomic_write_text(out_dir / MANIFEST, json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_harvest(path, tokenizer=None) -> tuple:
    """(dataset of all rows, manifest); DataError for a missing or empty harvest, or one harvested with
    another tokenizer than `tokenizer` (the recipe's, when it names one)."""
    import datasets

    from draftforge.data.provenance import check_record, notice, tokenizer_identity

    path = Path(path)
    if not (path / MANIFEST).is_file():
        raise DataError(f"{path} is not a θ harvest (no {MANIFEST}); make one with `draftforge harvest theta`")
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise DataError(f"{path / MANIFEST}: not readable JSON ({e}); harvest again into a new --out") from None
    if not isinstance(manifest, dict) or manifest.get("kind", KIND) != KIND or "shards" not in manifest:
        kind = manifest.get("kind") if isinstance(manifest, dict) else None
        raise DataError(f"{path} holds {'a ' + kind if kind else 'something else'}, not a θ harvest; point "
                        "data.sources at the --out of `draftforge harvest theta`")
    if "rows" not in manifest or "mean_label" not in manifest:  # written when the harvest finishes
        raise DataError(f"the θ harvest in {path} is incomplete ({len(manifest['shards'])} shards so far): finish it "
                        "with the same `draftforge harvest theta` command and --resume")
    if tokenizer is not None and not check_record(manifest, tokenizer_identity(tokenizer), str(path), TRAIN_FIX):
        notice([str(path)], "the θ harvest records no tokenizer fingerprint (an older harvest, or a target without "
                            "tokenizer files): its tokenizer cannot be checked")
    shards = [path / "shards" / f"shard-{int(k):05d}" for k, v in sorted(manifest["shards"].items(), key=lambda kv:
                                                                            int(kv[0])) if v["rows"]]
    if not shards:
        raise DataError(f"the θ harvest in {path} is empty (0 rows): its sequences were shorter than 2 tokens or "
                        "none was read; harvest longer sequences")
    parts = [datasets.load_from_disk(str(s)) for s in shards]
    if not all("sequence" in part.column_names for part in parts):  # shards an older draftforge wrote have none
        parts = [part.remove_columns(["sequence"]) if "sequence" in part.column_names else part for part in parts]
    return datasets.concatenate_datasets(parts), manifest


# ---------------------------------------------------------------- command line

# `--help` text for users; the module docstring above is for readers of the code (positions, legend).
DESCRIPTION = """\
Label, for the Cali-TS θ predictor, which drafts the target would accept. The target and the drafter each
read every held-out sequence once (teacher-forced). At one anchor every --anchor-stride tokens and for each
draft offset i = 1..--max-offset, one row holds the target's hidden state, the drafter's hidden state, i,
and the label χ: 1 when the drafter's top token equals the target's there, else 0.

--data gives token rows (their prompt_len / loss_mask part is labelled) or text rows (tokenized with the
target's tokenizer); --generate N labels the target's own greedy continuation of each row instead. The
drafter may be any kind `draftforge eval` takes, an EESD export of this target too.

Rows are saved in shards of --shard-size sequences under OUT/shards/, with OUT/harvest.json recording the
models and settings; an interrupted harvest continues with --resume."""

EPILOG = """examples:
  draftforge harvest theta --target TARGET --drafter DRAFTER --data heldout.jsonl --out runs/theta-harvest
  draftforge harvest theta ... --generate 128 --max-sequences 200   # label the target's own continuations
  draftforge harvest theta ... --resume                             # continue a killed harvest
  draftforge harvest theta --target TARGET --drafter runs/eesd/export ...   # an EESD exit head on TARGET
then train the predictor: draftforge train RECIPE (task: theta, data.sources: [runs/theta-harvest])
"""


@dataclass(frozen=True, kw_only=True)
class ThetaHarvestJob(HarvestJob):
    """`draftforge harvest theta`: its flags are these settings."""

    target: str = option(MISSING, "the target model (local path)")
    drafter: str = option(MISSING, "the trained drafter (export dir or local path; an EESD export of this target too)")
    data: tuple[str, ...] = option(MISSING, "JSONL rows: input_ids (token rows, prompt_len / loss_mask mark the "
                                   "labelled part) or text; one or more, flag repeatable", repeat=True, metavar="ROWS")
    max_offset: int = option(16, "draft offsets i = 1..N per anchor (offsets past 10 share W^10)", check=positive_int)
    anchor_stride: int = option(8, "one anchor every N positions", check=positive_int)
    max_len: int = option(512, "cut sequences to N tokens", check=positive_int)
    generate: int = option(0, "first continue each row greedily by N target tokens and label only those (0: the "
                           "rows as they are)", check=non_negative_int)
    max_sequences: int | None = option(None, "read at most N rows (default: all)", check=positive_int)
    shard_size: int = option(64, "sequences per saved shard", check=positive_int)
    allow_vocab_mismatch: bool = option(False, "a drafter whose tokenizer differs from the target's: use token ids "
                                        "as they are (as eval's flag of the same name)")
    overwrite: bool = option(False, "replace a harvest in --out")


def configure(p: argparse.ArgumentParser) -> None:
    p.description, p.epilog = DESCRIPTION, EPILOG
    add_flags(p, ThetaHarvestJob)


def run_job(job: ThetaHarvestJob) -> int:
    m = harvest_theta(job.target, job.drafter, list(job.data), job.out, max_offset=job.max_offset,
                      anchor_stride=job.anchor_stride, max_len=job.max_len, generate=job.generate,
                      max_sequences=job.max_sequences, shard_size=job.shard_size, resume=job.resume,
                      overwrite=job.overwrite, device=job.device, allow_vocab_mismatch=job.allow_vocab_mismatch,
                      dtype=job.dtype)
    mean = f"{m['mean_label']:.3f}" if m["mean_label"] is not None else "n/a"
    print(f"harvested {m['rows']} rows ({len(m['shards'])} shards), mean acceptance χ {mean}, "
          f"target width {m['target_dim']}, drafter width {m['draft_dim']} -> {job.out}")
    return 0
