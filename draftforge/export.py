"""Exported checkpoints: safetensors + config.json + tokenizer + draftforge.json, written atomically.

An export directory loads with plain `AutoModelForCausalLM.from_pretrained(DIR)`, except one with a reduced draft
vocabulary (`model.draft_vocab`): its lm_head holds the draft vocabulary's rows only, which transformers refuses
against the config's vocabulary (and, told to ignore sizes, replaces with a random head), so it loads with
draftforge's loader (`load_drafter`, the harness, `speculative_generate`). The `draftforge.json` beside it says
which method made it, for which target (by name), with which tokenizer (by fingerprint), so a drafter is never
paired silently with a target of another tokenizer (it would decode losslessly, accepting little).
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import time
import uuid
from pathlib import Path

import torch

import draftforge
from draftforge.errors import CheckpointError, CompatibilityError
from draftforge.fsutil import read_json, write_dir_atomically

FORMAT_VERSION = 1
METADATA_FILE = "draftforge.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pkl", ".pth", ".pickle")
# Keys that identify an export: re-exporting the same run (e.g. after a resume) may replace it,
# anything else in the way is refused unless overwrite=True.
_IDENTITY_KEYS = ("task", "target", "recipe", "run_dir")


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 over the vocabulary (token -> id, sorted) and the special tokens; stable across save/load."""
    special = {name: getattr(tokenizer, name, None) for name in ("bos_token", "eos_token", "pad_token", "unk_token")}
    payload = {"vocab": sorted(tokenizer.get_vocab().items()), "special": {k: str(v) if v is not None else None
                                                                           for k, v in special.items()}}
    blob = json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return hashlib.sha256(blob).hexdigest()


def check_tokenizer_compat(drafter_tok, target_tok) -> None:
    """CompatibilityError unless drafter and target tokenize identically (same vocab and special tokens)."""
    if tokenizer_fingerprint(drafter_tok) == tokenizer_fingerprint(target_tok):
        return
    raise CompatibilityError(
        f"drafter tokenizer {getattr(drafter_tok, 'name_or_path', '?')!r} ({len(drafter_tok)} tokens) differs from "
        f"target tokenizer {getattr(target_tok, 'name_or_path', '?')!r} ({len(target_tok)} tokens); "
        "train the drafter with the target's tokenizer")


def _jsonable(value):
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        value = dataclasses.asdict(value)
    return json.loads(json.dumps(value, default=str))


def _mergeable_model(model: torch.nn.Module) -> torch.nn.Module:
    """The plain transformers model to save: LoRA adapters merged into a copy, the caller's model untouched."""
    try:
        from peft import PeftModel
    except ImportError:  # peft is a dependency, but export must not need it for plain models
        return model
    if isinstance(model, PeftModel):
        return copy.deepcopy(model).merge_and_unload()
    return model


def check_not_foreign(out_dir: Path) -> dict | None:
    """Refuse a destination that is a file or a non-empty directory holding no readable draftforge export (never
    replaced, not even with --overwrite); the export there, if any. Cheap: callers check it before loading a model."""
    out_dir = Path(out_dir)
    if not out_dir.exists():
        return None
    if not out_dir.is_dir():
        raise CheckpointError(f"export path {out_dir} exists and is not a directory; choose another --out")
    if not any(out_dir.iterdir()):
        return None
    try:
        return read_export_metadata(out_dir)
    except CheckpointError:  # never delete someone's unrelated files, even with --overwrite
        raise CheckpointError(f"{out_dir} already holds files that are not a readable draftforge export; "
                              "choose another --out or remove that directory yourself") from None


def _same_place(recipe):
    """A recipe with its output_dir as an absolute path: `runs/x`, `./runs/x/` and `/abs/runs/x` are one run."""
    if isinstance(recipe, dict) and isinstance(recipe.get("output_dir"), str):
        return {**recipe, "output_dir": str(Path(recipe["output_dir"]).expanduser().resolve())}
    return recipe


def _differing_keys(old, new, at: str = "") -> list[str]:
    """The dotted keys whose values differ between two nested dicts (a recipe: a line, not two whole dicts)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return [] if old == new else [at or "(value)"]
    return [key for k in sorted(set(old) | set(new), key=str)
            for key in _differing_keys(old.get(k), new.get(k), f"{at}.{k}" if at else str(k))]


def _check_destination(out_dir: Path, identity: dict, overwrite: bool) -> None:
    """Refuse to replace a different export (unless overwrite) or anything that is not an export (ever)."""
    existing = check_not_foreign(out_dir)
    if existing is None:
        return
    existing = {**existing, "recipe": _same_place(existing.get("recipe"))}
    identity = {**identity, "recipe": _same_place(identity.get("recipe"))}
    differ = [k for k in _IDENTITY_KEYS if existing.get(k) != identity.get(k)]
    if not overwrite and differ:
        said = []
        for k in differ:
            if k == "recipe" and isinstance(existing.get(k), dict) and isinstance(identity.get(k), dict):
                keys = _differing_keys(existing[k], identity[k])
                said.append(f"its recipe differs in {', '.join(keys[:5])}" + (" ..." if len(keys) > 5 else ""))
            else:
                said.append(f"its {k} {existing.get(k)!r}, this one's {identity.get(k)!r}")
        raise CheckpointError(f"{out_dir} already holds a different export ({'; '.join(said)}); choose another "
                              "--out or pass --overwrite")


GENERATE_PY = '''r"""Written by `draftforge export`: transformers' generate() runs speculative decoding with this drafter.

    out = target.generate(**inputs, custom_generate="{export}", trust_remote_code=True, max_new_tokens=128)

Needs draftforge installed where it runs; drafter= overrides the drafter directory below (after the export was
moved or copied: a directory that holds another export by now is refused), method= / method_options= choose the
draftforge method (default chain). See docs/use-your-drafter.md in draftforge.
"""

from draftforge.decode.hf_generate import generate_from_export

DRAFTER_DIR = {export!r}
EXPORT_ID = {export_id!r}  # this export's draftforge.json says the same


def generate(*args, model, **kwargs):
    return generate_from_export(model, DRAFTER_DIR, *args, export_id=EXPORT_ID, **kwargs)
'''


def export_model(model: torch.nn.Module, tokenizer, out_dir, *, metadata: dict, overwrite: bool = False) -> Path:
    """Write model + tokenizer + draftforge.json into `out_dir` atomically (temp dir beside it, then rename)."""
    out_dir = Path(out_dir).resolve()
    metadata = _jsonable(metadata)
    if not metadata.get("task"):
        raise CheckpointError("export metadata needs a 'task' (pretrain, sft, eesd, ...)")
    identity = {k: metadata.get(k) for k in _IDENTITY_KEYS}
    _check_destination(out_dir, identity, overwrite)
    export_id = uuid.uuid4().hex  # names this export: a generate.py copied elsewhere knows when its directory changed
    record = {
        **metadata,
        "export_id": export_id,
        "format_version": FORMAT_VERSION,
        "task": metadata["task"],
        "target": metadata.get("target"),
        "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer),
        "recipe": metadata.get("recipe"),
        "draftforge_version": draftforge.__version__,
        "metrics": metadata.get("metrics", {}),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    return write_model_dir(_mergeable_model(model), tokenizer, out_dir,
                           {METADATA_FILE: json.dumps(record, indent=2, sort_keys=True) + "\n",
                            # transformers' generate(custom_generate=THIS_DIR, trust_remote_code=True) runs it
                            "custom_generate/generate.py": GENERATE_PY.format(export=str(out_dir), export_id=export_id)})


def write_model_dir(model, tokenizer, out_dir: Path, extra_files: dict[str, str] | None = None) -> Path:
    """Save model (safetensors) + tokenizer + extra text files into `out_dir` atomically (temp dir beside
    it, usual permissions, then a rename that replaces an old copy only once the new one is complete)."""
    def fill(tmp_dir: Path) -> None:
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        for name, text in (extra_files or {}).items():
            (tmp_dir / name).parent.mkdir(parents=True, exist_ok=True)
            (tmp_dir / name).write_text(text, encoding="utf-8")

    return write_dir_atomically(Path(out_dir), fill)


def read_export_metadata(path) -> dict:
    """The parsed draftforge.json of an export; CheckpointError if it is missing, corrupt or too new."""
    meta_path = Path(path) / METADATA_FILE
    if not meta_path.is_file():
        raise CheckpointError(f"{path} is not a draftforge export (no {METADATA_FILE}); "
                              "export a run with `draftforge export RUN_DIR --out DIR`")
    meta = read_json(meta_path, "re-export the run")
    if not isinstance(meta, dict) or "task" not in meta:
        raise CheckpointError(f"{meta_path} has no 'task' field; re-export the run")
    check_format_version(meta, meta_path)
    return meta


def check_format_version(meta: dict, where) -> None:
    """An export written by a newer draftforge (a higher format_version) is refused; one without the field
    predates it (θ predictors and C2T classifiers wrote none before 2026-12-03) and is read as version 1."""
    version = meta.get("format_version", 1)
    if not isinstance(version, int) or isinstance(version, bool) or version > FORMAT_VERSION:
        raise CheckpointError(f"{where} has format_version {version!r}, newer than this draftforge "
                              f"({FORMAT_VERSION}) reads; upgrade draftforge")


def load_exported(path, *, expected_task: str | None = None, device="cpu", dtype=None):
    """(model, tokenizer, metadata) of an export; refuses pickle files, another method's export, a tokenizer mismatch."""
    from transformers import AutoTokenizer

    from draftforge.loading import load_causal_lm

    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"export directory {path} does not exist")
    pickles = sorted(p.name for p in path.rglob("*") if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"{path} contains pickle files {pickles}; they can run arbitrary code when loaded, "
                              "so draftforge refuses them. Re-export with safetensors or delete them")
    meta = read_export_metadata(path)
    if expected_task is not None and meta["task"] != expected_task:
        raise CheckpointError(f"{path} is a {meta['task']!r} export, but a {expected_task!r} checkpoint is needed")
    model = load_causal_lm(path, what="export", dtype=dtype)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as err:
        raise CheckpointError(f"cannot load the export in {path}: {err}") from None
    if tokenizer_fingerprint(tokenizer) != meta.get("tokenizer_fingerprint"):
        raise CheckpointError(f"the tokenizer files in {path} do not match the fingerprint in {METADATA_FILE}; "
                              "the export was modified after it was written; re-export the run")
    return model.to(device).eval(), tokenizer, meta
