"""`draftforge harvest logits`: a target's top-k next-token distributions over token rows, for `distill`.

Length (~520 lines): one job whose steps (plan, shard, resume, merge across processes) read the same manifest; its
format lives in data/logits_cache.py. `draftforge harvest hidden` (harvest/hidden.py) is this job with `States`:
every row's states at chosen layers are stored beside the same entries. Before it starts, process 0 prints the
bytes the shards will take (`storage_estimate`), and a disk without that room is refused before any write.

The target reads each row once (teacher-forced, rows right-padded into batches of --batch-size, so padding
never reaches a position that is kept); for every position a loss uses, the K largest log-probabilities
(T=1, computed in float32 from the logits whatever --dtype the model runs in), the log of the remaining
mass and the argmax are written (the format: data/logits_cache.py). With --draft-vocab the top-K and the
remaining mass are taken over the draft ids only, which is what a reduced head's loss needs
(train/divergences.py); K may then not exceed the draft vocabulary.

Shards of --shard-rows rows are written atomically, each with a small record (its bytes and sha256) beside
it; harvest.json is the index, merged by process 0 at the end. A killed run continues with --resume: shards
whose file matches its record are kept, and a missing, truncated or corrupt one is harvested again, to the
same bytes (the same rows in the same batches). Under `accelerate launch` process r harvests shards r, r+W,
... (W processes; on GPUs each takes cuda:LOCAL_RANK) and the result is the same as one process's.
Legend: B rows of a batch, L their padded length, V vocabulary, S the vocabulary the top-k is taken over
(V or the draft ids), K top-k, P kept positions.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import MISSING, dataclass
from pathlib import Path

import torch

from draftforge.data.logits_cache import (DRAFT_VOCAB_FILE, FORMAT_VERSION, HIDDEN_KIND, KIND, KINDS, MANIFEST,
                                          check_ids_below, config_fingerprint, loss_positions, read_manifest,
                                          read_token_rows, rows_identity, shard_index, shard_name, shard_problem,
                                          stored_weights_fingerprint, write_shard)
from draftforge.errors import CompatibilityError, DataError, RecipeError
from draftforge.fsutil import atomic_write_text, foreign_dir_problem, shared_lock
from draftforge.harvest.job import HarvestJob
from draftforge.options import add_flags, option, positive_int
from draftforge.runtime import announce, device_name, mixed_devices_text, other_devices, resolve_dtype

ROWS_FIX = "regenerate the rows with this target, or pass --target {theirs}"
# what a resume must share with the harvest it continues (the target's weights are compared once loaded)
SETTING_KEYS = ("top_k", "max_len", "batch_size", "shard_rows", "dtype", "vocab_size", "draft_vocab",
                "tokenizer_fingerprint", "temperature", "layers", "pad_to")
POSITION_CHUNK = 256  # positions whose fp32 logits are processed at once (bounds the extra memory)
TOPK_NAMES = ("ids", "logp", "rest_logp", "top1")
STATE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}  # bytes per stored state value, by the target's dtype


@dataclass(frozen=True)
class States:
    """What `draftforge harvest hidden` adds (harvest/hidden.py): the states entering target layers `layers` (None:
    EAGLE-3's choice for the target's depth) at every position of each row's first max_len tokens, in the dtype the
    target ran in, each batch right-padded to max_len (as training pads its blocks) or, with pad_to_longest, to
    its longest row."""

    layers: list[int] | None = None
    pad_to_longest: bool = False


@dataclass
class Plan:
    """Everything decided before the model loads: the rows, their positions, the draft ids, the manifest."""

    rows: list[dict]
    positions: list[list[int]]
    draft_ids: list[int] | None
    manifest: dict
    device: str
    choice: object = None
    stop_after: int | None = None
    lengths: list[int] | None = None  # tokens of each row whose states are kept (with States)

    @property
    def say(self):
        name = KINDS[self.manifest["kind"]][1].removeprefix("draftforge ")
        return lambda line: print(f"[draftforge] {name}: {line}", file=sys.stderr, flush=True)


def harvest_logits(target, rows, out, *, top_k=32, draft_vocab=None, max_len=2048, batch_size=8, shard_rows=256,
                   device="cpu", dtype="auto", resume=False, overwrite=False, progress=True,
                   stop_after=None, states: States | None = None) -> dict:
    """Write (or continue) a logits cache in `out`; returns its manifest. With `states`, a hidden-state cache:
    the same entries plus the target's states (harvest/hidden.py). stop_after=n stops after this process wrote n
    shards, as a kill would (tests)."""
    for name, value in (("top_k", top_k), ("max_len", max_len), ("batch_size", batch_size),
                        ("shard_rows", shard_rows)):
        if not isinstance(value, int) or value < (2 if name == "max_len" else 1):
            raise RecipeError(f"--{name.replace('_', '-')} must be an integer >= {2 if name == 'max_len' else 1}, "
                              f"got {value!r}")
    if resume and overwrite:
        raise RecipeError("--resume continues a harvest and --overwrite replaces it: pass one of them")
    rank, world, local_rank = _process_group()
    out = Path(out)
    with shared_lock(out, "draftforge harvest", rank == 0, _share if world > 1 else None):  # one harvest per --out
        return _harvest(target, rows, out, top_k, draft_vocab, max_len, batch_size, shard_rows, device, dtype,
                        resume, overwrite, progress, stop_after, states, rank, world, local_rank)


def _share(problem):
    """Process 0's verdict on the lock, to every process of the gloo group."""
    import torch.distributed as dist

    box = [problem]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _harvest(target, rows, out: Path, top_k, draft_vocab, max_len, batch_size, shard_rows, device, dtype, resume,
             overwrite, progress, stop_after, states, rank: int, world: int, local_rank: int) -> dict:
    plan = _plan(target, rows, top_k, draft_vocab, max_len, batch_size, shard_rows, device, dtype, local_rank, world,
                 states)
    old = _existing(out, plan.manifest, resume, overwrite)  # read only: every process runs the same checks
    _check_room(out, plan, old, rank == 0)
    if rank == 0:
        announce(plan.choice, "target")
    model = _load_target(target, plan)
    _same_target(out, old, plan.manifest)
    _barrier(world)
    if rank == 0:
        _start(out, plan, overwrite)
    _barrier(world)
    done = {} if overwrite else _records(out, plan.manifest["kind"])
    plan.stop_after = stop_after
    _harvest_shards(model, plan, out, [i for i in range(plan.manifest["num_shards"]) if i % world == rank], done,
                    progress and rank == 0)
    _barrier(world)
    if rank == 0:
        _merge(out, plan.manifest)
    _barrier(world)
    return read_manifest(out, plan.manifest["kind"])


def _process_group() -> tuple[int, int, int]:
    """(rank, world size, local rank): one process, or `accelerate launch` / torchrun's (a gloo group for barriers)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, 0
    import torch.distributed as dist

    if not dist.is_initialized():
        from datetime import timedelta

        # barriers only: a process waits at one while another harvests a larger share or (process 0) checks every
        # shard of a cache of terabytes before the manifest is complete, which can outlast gloo's 30-minute
        # default; a process that fails ends the launch anyway (the launcher stops the others)
        dist.init_process_group("gloo", timeout=timedelta(hours=24))
    return dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", "0"))


def _barrier(world: int) -> None:
    if world > 1:
        import torch.distributed as dist

        dist.barrier()


def _plan(target, rows_path, top_k, draft_vocab, max_len, batch_size, shard_rows, device, dtype, local_rank,
          world, states: States | None = None) -> Plan:
    """Read and check the rows, the draft vocabulary and the settings; nothing is written or loaded yet."""
    from draftforge.data.provenance import tokenizer_identity
    from draftforge.loading import load_config

    config = load_config(str(target), "--target")
    vocab = int(config.vocab_size)
    tokenizer = _target_tokenizer(target)
    rows = read_token_rows(rows_path, tokenizer, ROWS_FIX)
    check_ids_below(rows, vocab)
    draft_ids, source = resolve_draft_vocab(draft_vocab, rows, vocab, tokenizer)
    scope = len(draft_ids) if draft_ids is not None else vocab
    if top_k > scope:
        what = f"the draft vocabulary's {scope} ids" if draft_ids is not None else f"the target's {scope} tokens"
        raise CompatibilityError(f"--top-k {top_k} exceeds {what}; use --top-k {scope} or less (--top-k {scope} "
                                 "stores that distribution whole, with no tail)")
    positions = [loss_positions(row["labels"], max_len) for row in rows]
    if not any(positions):
        raise DataError(f"no row of {rows_path} has a loss position within its first {max_len} tokens (every label "
                        "is -100 there, or rows are one token long): there is nothing to harvest or train on")
    lengths = None if states is None else [min(len(row["input_ids"]), max_len) for row in rows]
    longest = max(lengths) if lengths else max((p[-1] + 1 for p in positions if p), default=0)
    context = getattr(config, "max_position_embeddings", None)
    if context is not None and longest > context:
        raise RecipeError(f"rows of {rows_path} reach {longest} tokens, beyond the target's context of {context} "
                          f"positions; pass --max-len {context} (train with train.block_size <= {context})")
    if states is not None and not states.pad_to_longest and context is not None and max_len > context:
        raise RecipeError(f"--max-len {max_len}: every batch of states is padded to it, beyond the target's context of "
                          f"{context} positions (the rows reach {longest}); pass --max-len {context} or less")
    if world > 1 and str(device).startswith("cuda"):
        device = f"cuda:{local_rank}"
    choice = resolve_dtype(dtype, device)
    manifest = {
        "kind": KIND, "format_version": FORMAT_VERSION, "target": str(target), "target_fingerprint": None,
        "target_files": stored_weights_fingerprint(target), "target_config": config_fingerprint(target),
        **tokenizer_identity(tokenizer), "vocab_size": vocab,
        "rows": {**rows_identity(rows_path), "count": len(rows), "positions": sum(map(len, positions))},
        "top_k": top_k, "max_len": max_len, "batch_size": batch_size, "shard_rows": shard_rows,
        "num_shards": -(-len(rows) // shard_rows), "dtype": choice.name, "dtype_reason": choice.reason,
        "temperature": 1.0, "store": {"ids": "int32", "logp": "float32", "rest_logp": "float32", "top1": "int32"},
        "draft_vocab": _draft_record(draft_ids, source), "complete": False, "shards": []}
    if states is not None:
        add_states(manifest, config, states, lengths, max_len, choice.name)
    manifest["storage"] = storage_estimate(manifest)
    return Plan(rows, positions, draft_ids, manifest, device, choice, lengths=lengths)


def add_states(manifest: dict, config, states: States, lengths: list[int], max_len: int, dtype: str) -> None:
    """The manifest of a hidden-state cache: the kind, the layer ids (checked against the target's depth), the
    stored width and dtype, the padding and the tokens whose states are kept."""
    from draftforge.models.eagle3 import check_aux_layers, default_aux_layers

    depth = config.num_hidden_layers
    ids = check_aux_layers(default_aux_layers(depth) if states.layers is None else states.layers, depth, "--layers")
    manifest["rows"]["tokens"] = sum(lengths)
    manifest.update(kind=HIDDEN_KIND, layers=ids, num_layers=depth, hidden_size=config.hidden_size,
                    state_width=len(ids) * config.hidden_size, state_bytes=STATE_BYTES[dtype],
                    pad_to=None if states.pad_to_longest else max_len)
    manifest["store"].update(states=dtype, token_ptr="int64")


def storage_estimate(m: dict) -> dict:
    """Bytes the shards will hold, from the manifest's counts: per kept position K int32 ids, K float32 log-probs,
    the rest's log-mass, the argmax and the position (8K + 12 B); per row a pointer (8 B); with states, per row one
    more pointer and per token the A stored values of the states (A · 2 B in bfloat16)."""
    rows = m["rows"]
    per_position, per_token = 8 * m["top_k"] + 12, m.get("state_width", 0) * m.get("state_bytes", 0)
    total = (rows["positions"] * per_position + rows.get("tokens", 0) * per_token
             + (rows["count"] + m["num_shards"]) * (16 if per_token else 8) + m["num_shards"] * 1024)  # headers
    return {"bytes": total, "per_position": per_position, "per_token": per_token}


def _check_room(out: Path, plan: Plan, old: dict | None, say: bool) -> None:
    """Say what the shards will take (rank 0), and refuse before any write when the disk holding `out` lacks it."""
    import shutil

    need = plan.manifest["storage"]["bytes"]
    kept = 0  # the shards a resume will keep: recorded, at their recorded size (a damaged one is hashed later)
    for entry in _records(out, plan.manifest["kind"]).values() if old is not None else []:
        path = out / entry["file"]
        if path.is_file() and path.stat().st_size == entry["bytes"]:
            kept += entry["bytes"]
    where = next(p for p in (out, *out.parents) if p.exists())
    free = shutil.disk_usage(where).free
    s, m = plan.manifest["storage"], plan.manifest
    if say:
        parts = [f"{m['rows']['positions']:,} positions x {s['per_position']} B"]
        if s["per_token"]:
            parts.append(f"{m['rows']['tokens']:,} tokens x {s['per_token']:,} B ({m['state_width']:,} "
                         f"{m['store']['states']} values)")
        plan.say(f"will write about {_size(need)} ({' + '.join(parts)}; {_size(max(need - kept, 0))} still to "
                 f"write, {_size(free)} free at {where})")
    if need - kept > free:
        raise DataError(f"--out {out}: the harvest needs about {_size(need - kept)} more, but {where} has "
                        f"{_size(free)} free; free space, choose another --out, or harvest fewer rows")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n):,} B"
        n /= 1024
    return ""


def _target_tokenizer(target):
    """The target's tokenizer, None when its directory holds none (ids are then used unchecked)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(target))
    except (OSError, ValueError, TypeError):
        return None


def resolve_draft_vocab(spec, rows: list[dict], vocab: int, tokenizer) -> tuple[list[int] | None, str | None]:
    """The draft ids --draft-vocab names: N (the N most frequent labels of these rows, as a recipe with
    model.draft_vocab: N and model.draft_vocab_from: ROWS counts them), a run or export dir, or a JSON list."""
    from draftforge.models.draft_vocab import check_map, frequent_tokens

    if spec is None:
        return None, None
    spec = str(spec)
    if spec.isdigit():
        n = int(spec)
        if not 0 < n <= vocab:
            raise RecipeError(f"--draft-vocab {n}: must be in 1..{vocab} (the target's vocabulary)")
        eos = getattr(tokenizer, "eos_token_id", None)
        return frequent_tokens((row["labels"] for row in rows), vocab, n, always=(eos,)), f"{n} most frequent"
    ids = _draft_ids_from(Path(os.path.expanduser(spec)))
    check_map(ids, vocab)
    return sorted(int(t) for t in ids), spec


def _draft_ids_from(path: Path) -> list[int]:
    candidates = [path] if path.is_file() else [path / DRAFT_VOCAB_FILE, path / "config.json",
                                                path / "export" / "config.json"]
    for file in candidates:
        if not file.is_file():
            continue
        try:
            value = json.loads(file.read_text())
        except ValueError as e:
            raise DataError(f"--draft-vocab: {file} is not readable JSON ({e})") from None
        value = value.get("draft_vocab") if isinstance(value, dict) else value
        if isinstance(value, list) and value and all(isinstance(t, int) for t in value):
            return value
    raise DataError(f"--draft-vocab {path}: no draft vocabulary there (give N, a run dir with {DRAFT_VOCAB_FILE}, an "
                    "export whose config.json lists draft_vocab, or a JSON list of target ids)")


def _draft_record(ids, source) -> dict | None:
    if ids is None:
        return None
    import hashlib

    return {"size": len(ids), "source": source, "sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()}


def _existing(out: Path, manifest: dict, resume: bool, overwrite: bool) -> dict | None:
    """The harvest already in `out` that a --resume continues (checked to share the settings), else None."""
    if not (out / MANIFEST).is_file():
        problem = foreign_dir_problem(out, MANIFEST, "a harvest")  # a run dir has a draft_vocab.json too
        if problem:
            raise DataError(problem)
        if resume:
            print(f"[draftforge] --resume: {out} holds no harvest yet; starting one", file=sys.stderr, flush=True)
        return None
    old = read_manifest(out, manifest["kind"])
    if overwrite:
        return None
    if not resume:
        raise DataError(f"{out} already holds {KINDS[manifest['kind']][0]}; pass --resume to continue it, "
                        "--overwrite to replace it, or choose another --out")
    def same(key: str) -> bool:  # a draft vocabulary is its ids, not how they were given (N, or a file of them)
        a, b = old.get(key), manifest.get(key)
        if key == "draft_vocab" and isinstance(a, dict) and isinstance(b, dict):
            return (a.get("size"), a.get("sha256")) == (b.get("size"), b.get("sha256"))
        return a == b

    def shown(m: dict, key: str):
        if key == "tokenizer_fingerprint":  # the tokenizer's name where recorded, and a short fingerprint
            return f"{m.get('tokenizer') or '?'} ({str(m.get(key))[:12]})"
        return m.get(key)

    changed = [f"{k.removesuffix('_fingerprint')} {shown(old, k)} -> {shown(manifest, k)}" for k in SETTING_KEYS
               if not same(k)]
    if "target_config" in old and old["target_config"] != manifest.get("target_config"):  # older: not recorded
        same_path = str(old.get("target")) == str(manifest.get("target"))
        changed.append(f"the target's config.json ({old.get('target')}'s, edited since the harvest started)"
                       if same_path else f"the target's config.json ({old.get('target')} -> {manifest.get('target')}: "
                                         "another model)")
    if old["rows"].get("sha256") != manifest["rows"]["sha256"]:
        changed.append(f"rows file sha256 {str(old['rows'].get('sha256'))[:12]} -> {manifest['rows']['sha256'][:12]}")
    if changed:
        raise CompatibilityError(f"--resume: the harvest in {out} was made with other settings ({'; '.join(changed)}); "
                                 "use the same ones, or --overwrite")
    return old


def _load_target(target, plan: Plan):
    from draftforge.loading import load_causal_lm
    from draftforge.models.cali_ts import model_fingerprint

    model = load_causal_lm(str(target), what="target", dtype=plan.choice.torch_dtype)
    model = model.to(plan.device).eval().requires_grad_(False)
    plan.manifest["target_fingerprint"] = model_fingerprint(model)
    return model


def _same_target(out: Path, old: dict | None, manifest: dict) -> None:
    if old is not None and old.get("target_fingerprint") != manifest["target_fingerprint"]:
        raise CompatibilityError(f"--resume: the harvest in {out} was made with target {old.get('target')} (weights "
                                 f"fingerprint {str(old.get('target_fingerprint'))[:12]}), not with this --target "
                                 f"({manifest['target_fingerprint'][:12]}); use that target, or --overwrite")


def _start(out: Path, plan: Plan, overwrite: bool) -> None:
    """Process 0: clear a replaced harvest (only the files a harvest writes), then write the manifest."""
    out.mkdir(parents=True, exist_ok=True)
    for path in _ours(out, "safetensors.tmp"):  # a killed write's half shard (the lock keeps out live ones)
        path.unlink(missing_ok=True)
    if overwrite and (out / MANIFEST).is_file():  # the replaced harvest's own files: its shards, and its vocabulary
        old = read_manifest(out, plan.manifest["kind"])
        n = old.get("num_shards") if isinstance(old.get("num_shards"), int) else 0
        for path in [p for p in _ours(out, "safetensors") if shard_index(p) < n]:
            path.unlink()
        for path in [p for p in _ours(out, "json") if shard_index(p) < n and _read_record(p) is not None]:
            path.unlink()
        if old.get("draft_vocab"):
            (out / DRAFT_VOCAB_FILE).unlink(missing_ok=True)
    if plan.draft_ids is not None:
        atomic_write_text(out / DRAFT_VOCAB_FILE, json.dumps(plan.draft_ids) + "\n")
    old = read_manifest(out, plan.manifest["kind"]) if (out / MANIFEST).is_file() and not overwrite else {}
    atomic_write_text(out / MANIFEST, json.dumps({**plan.manifest, "shards": old.get("shards", [])}, indent=2) + "\n")


def _ours(out: Path, suffix: str) -> list[Path]:
    """The shard files (and records, and half-written shards) a harvest writes in `out`, by their exact names
    (shard_name's): a user's own shard-notes.json beside them is neither read nor deleted."""
    name = re.compile(r"\.shard-\d{5,}\.safetensors\.tmp" if suffix.endswith(".tmp")
                      else r"shard-\d{5,}\." + re.escape(suffix))
    return sorted(p for p in out.glob(f"*{suffix}") if name.fullmatch(p.name))


def _record_path(out: Path, index: int) -> Path:
    return out / shard_name(index).replace(".safetensors", ".json")


def _records(out: Path, kind: str) -> dict[int, dict]:
    """Shard records of earlier runs: the manifest's, then the per-shard ones written since."""
    found = {}
    if (out / MANIFEST).is_file():
        found.update({e["index"]: e for e in read_manifest(out, kind).get("shards", [])})
    for path in _ours(out, "json"):
        entry = _read_record(path)
        if entry is not None:  # else unreadable, or not a record of this shard: the shard is harvested again
            found[entry["index"]] = entry
    return found


def _read_record(path: Path) -> dict | None:
    """The shard record a harvest wrote at `path`, or None for anything else there (unreadable, or not the record
    of that shard: a file the harvest did not write is neither trusted nor deleted)."""
    try:
        entry = json.loads(path.read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    index = shard_index(path)
    ok = (isinstance(entry, dict) and entry.get("index") == index and entry.get("file") == shard_name(index)
          and isinstance(entry.get("rows"), list) and isinstance(entry.get("bytes"), int)
          and isinstance(entry.get("sha256"), str))
    return entry if ok else None


def _harvest_shards(model, plan: Plan, out: Path, mine: list[int], done: dict, progress: bool) -> None:
    from tqdm.auto import tqdm

    m, say = plan.manifest, plan.say
    kept, todo = [], []
    for index in mine:  # an earlier run's shards, each checked against its record before it is kept
        problem = shard_problem(out, done[index]) if index in done else None
        if problem:
            say(f"{problem}: harvesting it again")
        (kept if index in done and not problem else todo).append(index)
    if kept:
        say(f"kept {len(kept)} of {len(mine)} shards an earlier run wrote (each checked against its sha256)")
    device = device_name(plan.device)
    others = other_devices([done[i].get("device") for i in kept], device)
    if others and todo:
        say(f"notice: {mixed_devices_text(others, device)}")
    # the bar starts at the kept shards, so its rate and ETA count only the shards harvested now
    bar = tqdm(total=len(mine), initial=len(kept), desc=f"{KINDS[m['kind']][1].removeprefix('draftforge ')} "
               "(shards)", disable=not progress, dynamic_ncols=True)
    written = 0
    for index in todo:
        a, b = index * m["shard_rows"], min((index + 1) * m["shard_rows"], m["rows"]["count"])
        tensors = shard_tensors(model, plan, a, b)
        meta = {"kind": m["kind"], "shard": index, "rows": f"{a}:{b}", "top_k": m["top_k"]}
        entry = {"index": index, "rows": [a, b], "positions": int(tensors["position"].numel()), "device": device,
                 **({"tokens": int(tensors["states"].shape[0])} if "states" in tensors else {}),
                 **write_shard(out / shard_name(index), tensors, meta)}
        atomic_write_text(_record_path(out, index), json.dumps(entry) + "\n")
        bar.update(1)
        written += 1
        if plan.stop_after is not None and written >= plan.stop_after:
            bar.close()
            raise KeyboardInterrupt(f"stopped after {written} shard(s) (stop_after)")
    bar.close()


def _merge(out: Path, manifest: dict) -> None:
    """Process 0, after every process finished: the manifest lists every shard, checked, and is complete."""
    records = _records(out, manifest["kind"])
    missing = [i for i in range(manifest["num_shards"]) if i not in records]
    if missing:
        raise DataError(f"harvest in {out}: shards {missing[:5]} were not written; rerun with --resume")
    shards = [records[i] for i in range(manifest["num_shards"])]
    for entry in shards:
        problem = shard_problem(out, entry)
        if problem:
            raise DataError(f"harvest in {out}: {problem}; rerun with --resume")
    atomic_write_text(out / MANIFEST, json.dumps({**manifest, "shards": shards, "complete": True}, indent=2) + "\n")
    for index in range(manifest["num_shards"]):  # the manifest holds them now
        path = _record_path(out, index)
        if path.is_file() and _read_record(path) is not None:
            path.unlink()


@torch.inference_mode()
def shard_tensors(model, plan: Plan, a: int, b: int) -> dict[str, torch.Tensor]:
    """The cache tensors of rows [a, b): batches of --batch-size rows, in order."""
    m = plan.manifest
    d2t_S = torch.tensor(plan.draft_ids, device=plan.device) if plan.draft_ids is not None else None
    parts, counts = [], []
    for c in range(a, b, m["batch_size"]):
        end = min(c + m["batch_size"], b)
        capture = None if plan.lengths is None else (m["layers"], plan.lengths[c:end], m["pad_to"])
        parts.append(batch_entries(model, plan.rows[c:end], plan.positions[c:end], m["top_k"], d2t_S, plan.device,
                                   capture))
        counts += [len(p) for p in plan.positions[c:end]]
    out = {name: torch.cat([p[name] for p in parts]) for name in parts[0]}
    out["position"] = torch.tensor([t for p in plan.positions[a:b] for t in p], dtype=torch.int32)
    out["row_ptr"] = torch.tensor([0, *counts], dtype=torch.int64).cumsum(0)
    if plan.lengths is not None:
        out["token_ptr"] = torch.tensor([0, *plan.lengths[a:b]], dtype=torch.int64).cumsum(0)
    return out


def batch_entries(model, rows: list[dict], positions: list[list[int]], k: int, d2t_S, device,
                  capture: tuple | None = None) -> dict:
    """One teacher forward over right-padded rows; the entries of their kept positions, row by row. With
    capture = (layers, lengths, pad_to): also `states`, the concat of hidden_states[i] for i in layers at each
    row's first lengths[r] positions, rows after each other, in the model's dtype; the batch is padded to pad_to
    tokens (None: its longest row)."""
    L = max((p[-1] + 1 for p in positions if p), default=0)
    empty = {"ids": torch.zeros(0, k, dtype=torch.int32), "logp": torch.zeros(0, k), "rest_logp": torch.zeros(0),
             "top1": torch.zeros(0, dtype=torch.int32)}
    if capture is not None:
        layers, lengths, pad_to = capture
        L = pad_to or max(lengths)
        empty["states"] = torch.zeros(0, len(layers) * model.config.hidden_size, dtype=model.dtype)
    if L == 0:
        return empty
    ids_BL = torch.zeros(len(rows), L, dtype=torch.long)
    for r, row in enumerate(rows):
        ids = row["input_ids"][:L]
        ids_BL[r, : len(ids)] = torch.tensor(ids)
    out = model(input_ids=ids_BL.to(device), use_cache=False, output_hidden_states=capture is not None)
    logits_BLV, parts = out.logits, []
    for r, pos in enumerate(positions):
        for c in range(0, len(pos), POSITION_CHUNK):
            at = torch.tensor(pos[c: c + POSITION_CHUNK], device=logits_BLV.device)
            parts.append(topk_entries(logits_BLV[r, at].float(), k, d2t_S))
    got = {name: torch.cat([p[name] for p in parts]).cpu() if parts else empty[name] for name in TOPK_NAMES}
    if capture is not None:
        from draftforge.models.eagle3 import aux_states

        states_BLA = aux_states(out.hidden_states, layers)  # as task eagle3's online loss fuses them
        got["states"] = torch.cat([states_BLA[r, :n] for r, n in enumerate(lengths)]).cpu()
    return got


def topk_entries(logits_PV: torch.Tensor, k: int, d2t_S=None) -> dict[str, torch.Tensor]:
    """Top-k ids and log-probs over S, the log of the rest of S's mass, the argmax over V (all from fp32 logits)."""
    lZ_P = logits_PV.logsumexp(-1)
    scope_PS = logits_PV if d2t_S is None else logits_PV.index_select(-1, d2t_S)
    val_PK, idx_PK = scope_PS.topk(k, -1)
    rest_P = scope_PS.scatter(-1, idx_PK, float("-inf")).logsumexp(-1) - lZ_P
    ids_PK = idx_PK if d2t_S is None else d2t_S[idx_PK]
    return {"ids": ids_PK.to(torch.int32), "logp": val_PK - lZ_P[:, None], "rest_logp": rest_P,
            "top1": logits_PV.argmax(-1).to(torch.int32)}


# ---------------------------------------------------------------- command line

DESCRIPTION = """\
Store a target's next-token distributions over token rows, so `distill` trains without a teacher forward
(recipe key distill.logits_cache: OUT; the teacher is then never loaded). The target reads every row of
--data (format: tokens JSONL/JSON/parquet rows {input_ids, prompt_len or loss_mask}) once; at each position
a loss uses it keeps the --top-k largest log-probabilities (T=1), the log of the remaining mass and its
argmax. Log-probs are stored as float32 whatever --dtype the model ran in (bf16 would cost them up to 3%
of a probability). With --draft-vocab the top-k and the remaining mass are over the draft ids, as a reduced
head's loss needs them.

OUT holds safetensors shards of --shard-rows rows and harvest.json (the target's and tokenizer's
fingerprints, the rows file's path, size, mtime and sha256, k, dtype, shards). An interrupted harvest
continues with --resume; a missing, truncated or corrupt shard is harvested again. Under
`accelerate launch` each process harvests its own shards and process 0 writes the index."""

EPILOG = """examples:
  draftforge harvest logits --target TARGET --data rows.jsonl --out runs/logits
  draftforge harvest logits ... --resume                              # continue a killed harvest
  draftforge harvest logits ... --draft-vocab 8192                    # a reduced head of 8192 ids
  accelerate launch -m draftforge harvest logits --device cuda ...    # one shard subset per GPU
then: draftforge train RECIPE (task: distill, distill.logits_cache: runs/logits, data.sources: [rows.jsonl],
data.format: tokens, distill.temperature: 1: the cache holds the T=1 distribution)
"""


@dataclass(frozen=True, kw_only=True)
class LogitsHarvestJob(HarvestJob):
    """`draftforge harvest logits`: its flags are these settings."""

    target: str = option(MISSING, "the target model (local directory)")
    data: str = option(MISSING, "one file of token rows (format: tokens), the one distill trains on", metavar="ROWS")
    top_k: int = option(32, "log-probabilities kept per position", check=positive_int)
    draft_vocab: str | None = option(None, "take the top-k over a reduced head's ids: N (the N most frequent labels "
                                     "of --data, as model.draft_vocab: N with model.draft_vocab_from: DATA), a run "
                                     "or export dir, or a JSON list of target ids (default: the whole vocabulary)")
    max_len: int = option(2048, "read at most N tokens of a row (at least the train.block_size that will read the "
                          "cache)", check=positive_int)
    batch_size: int = option(8, "rows per teacher forward", check=positive_int)
    shard_rows: int = option(256, "rows per shard", check=positive_int)
    overwrite: bool = option(False, "replace the harvest in --out")


def configure(p: argparse.ArgumentParser) -> None:
    p.description, p.epilog = DESCRIPTION, EPILOG
    add_flags(p, LogitsHarvestJob)


def run_job(job: LogitsHarvestJob) -> int:
    return run_harvest(job)


def run_harvest(job: LogitsHarvestJob, states: States | None = None) -> int:
    """The job's harvest (with `states`: a hidden-state cache), then one summary line from process 0."""
    m = harvest_logits(job.target, job.data, job.out, top_k=job.top_k, draft_vocab=job.draft_vocab,
                       max_len=job.max_len, batch_size=job.batch_size, shard_rows=job.shard_rows,
                       device=job.device, dtype=job.dtype, resume=job.resume, overwrite=job.overwrite, states=states)
    if int(os.environ.get("RANK", "0")) == 0:
        size = sum(e["bytes"] for e in m["shards"])
        held = (f", the states entering layers {m['layers']} at {m['rows']['tokens']:,} tokens "
                f"({m['state_width']:,} {m['store']['states']} values each)" if "layers" in m else "")
        print(f"{KINDS[m['kind']][1].removeprefix('draftforge ')}: {m['rows']['count']:,} rows, "
              f"{m['rows']['positions']:,} positions, top-{m['top_k']}"
              f"{' over ' + str(m['draft_vocab']['size']) + ' draft ids' if m['draft_vocab'] else ''}{held}, "
              f"{len(m['shards'])} shards ({size / 2**20:,.1f} MiB), {m['dtype']}; in {job.out}")
    return 0
