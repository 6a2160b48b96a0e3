"""Checkpoints as a first-class component: atomic writes, integrity manifest, resume.

A checkpoint is a directory `checkpoints/step-XXXXXXXX/` holding Accelerate's state (model,
optimizer, RNG states, registered scheduler) plus `loop_state.json` (step, tokens seen, the
recipe fingerprint) and `manifest.json` (size and sha256 of every file). It is written into a
hidden temp directory and renamed into place, so a run killed at any moment leaves only
complete checkpoints; a checkpoint whose files do not match its manifest is skipped on resume.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from draftforge.errors import CheckpointError
from draftforge.fsutil import sha256_file, usual_permissions

PREFIX = "step-"
# Recipe keys that may change between a run and its resume without changing the trained weights (with
# train.keep_best, eval_every decides which evals compete for the export, so the export may change).
RESUMABLE_KEYS = {"output_dir", "train.save_every", "train.eval_every", "train.log_every",
                  "train.keep_checkpoints", "train.trackers", "train.export", "data.num_proc",
                 "plugins"}


def flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v and k != "overrides":
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def recipe_differences(saved: dict, current: dict) -> list[str]:
    """Dotted keys whose values differ in a way that would change the training result."""
    a, b = flatten(saved), flatten(current)
    keys = sorted(set(a) | set(b))
    return [k for k in keys if k not in RESUMABLE_KEYS and a.get(k) != b.get(k) and not same_files(a.get(k), b.get(k))]


def same_files(a, b) -> bool:
    """Two spellings of the same existing files (a path or a list of them): runs/demo/testbed/x through a link, or
    relative where the run recorded it absolute. Contents are the inputs check's business (rundir)."""
    def paths(v):
        return [v] if isinstance(v, str) else v if isinstance(v, list) and all(isinstance(x, str) for x in v) else None

    pa, pb = paths(a), paths(b)
    if not pa or pb is None or len(pa) != len(pb):
        return False
    try:
        return all(Path(x).expanduser().exists() and Path(x).expanduser().resolve() == Path(y).expanduser().resolve()
                   for x, y in zip(pa, pb))
    except (OSError, RuntimeError, ValueError):
        return False


def write_manifest(ckpt_dir: Path) -> None:
    files = sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.name != "manifest.json")
    manifest = {str(p.relative_to(ckpt_dir)): {"size": p.stat().st_size, "sha256": sha256_file(p)} for p in files}
    _write_json_atomic(ckpt_dir / "manifest.json", manifest)


def verify(ckpt_dir: Path) -> str | None:
    """None if the checkpoint is complete and intact, else what is wrong with it."""
    mpath = ckpt_dir / "manifest.json"
    if not mpath.is_file():
        return "manifest.json is missing"
    try:
        manifest = json.loads(mpath.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return "manifest.json is corrupted"
    for rel, meta in manifest.items():
        p = ckpt_dir / rel
        if not p.is_file():
            return f"{rel} is missing"
        if p.stat().st_size != meta["size"]:
            return f"{rel} is truncated ({p.stat().st_size} of {meta['size']} bytes)"
        if sha256_file(p) != meta["sha256"]:
            return f"{rel} does not match its checksum"
    if "loop_state.json" not in manifest:
        return "loop_state.json is missing"
    return None


def list_checkpoints(run_dir: Path) -> list[Path]:
    """Complete-looking checkpoint dirs, newest first (temp dirs of a killed save are ignored)."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    dirs = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)]
    return sorted(dirs, key=lambda p: int(p.name[len(PREFIX):]), reverse=True)


def latest_valid(run_dir: Path, warn=print) -> Path:
    """The newest intact checkpoint; corrupted ones are reported and skipped."""
    ckpts = list_checkpoints(run_dir)
    if not ckpts:
        raise CheckpointError(f"--resume: no checkpoint in {Path(run_dir) / 'checkpoints'}; "
                              "start the run without --resume")
    for ckpt in ckpts:
        problem = verify(ckpt)
        if problem is None:
            return ckpt
        warn(f"checkpoint {ckpt.name} is unusable ({problem}); trying the previous one")
    raise CheckpointError(f"--resume: every checkpoint in {Path(run_dir) / 'checkpoints'} is corrupted; "
                          "start again with --overwrite")


def read_loop_state(ckpt_dir: Path) -> dict:
    return json.loads((ckpt_dir / "loop_state.json").read_text())


def begin(run_dir: Path, step: int) -> Path:
    """The temp directory a checkpoint is written into before `commit` renames it."""
    return Path(run_dir) / "checkpoints" / f".tmp-{PREFIX}{step:08d}"


def commit(tmp: Path, loop_state: dict, keep: int) -> Path:
    """Write the loop state and manifest, rename into place, prune old checkpoints (main process)."""
    _write_json_atomic(tmp / "loop_state.json", loop_state)
    usual_permissions(tmp)
    write_manifest(tmp)
    final = tmp.parent / tmp.name.removeprefix(".tmp-")
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    for old in list_checkpoints(final.parent.parent)[keep:]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def _write_json_atomic(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
