"""One safe way to load a causal LM.

`load_causal_lm` checks a local path before transformers sees it (a missing directory says so,
instead of the Hub's "Repo id must be in the form ..."), loads safetensors only (pickle weights
can run code when unpickled; opt in with `allow_pickle=True` or DRAFTFORGE_ALLOW_PICKLE=1), and
turns a file named `.safetensors` that is not one into a CheckpointError.
"""

from __future__ import annotations

import os
import re
import struct
from pathlib import Path

from draftforge.errors import CheckpointError

ALLOW_PICKLE_ENV = "DRAFTFORGE_ALLOW_PICKLE"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# "name" or "org/name": what the Hub accepts; anything else that does not exist is a missing local path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_MAX_HEADER = 100 * 2**20  # safetensors caps its JSON header at 100 MB


def pickle_allowed(allow_pickle: bool | None = None) -> bool:
    """An explicit argument wins; otherwise DRAFTFORGE_ALLOW_PICKLE=1 (the CLI's opt-in)."""
    if allow_pickle is not None:
        return allow_pickle
    return os.environ.get(ALLOW_PICKLE_ENV, "").strip().lower() in ("1", "true", "yes")


def local_model_dir(source, what: str = "model") -> Path | None:
    """The local directory `source` names, or None for a Hub id; CheckpointError for a missing local path."""
    text = str(source)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(f"{what} {text!r} is a file; give the model's directory (config.json + weights)")
        if not (path / "config.json").is_file():
            raise CheckpointError(f"{what} directory {path} holds no config.json, so it is not a Hugging Face "
                                  "model directory (for a draftforge run, use its export/ subdirectory)")
        return path
    if isinstance(source, Path) or not _HUB_ID.match(text):
        raise CheckpointError(f"cannot load the {what}: directory {path} does not exist")
    return None


def check_safetensors_file(path: Path) -> None:
    """CheckpointError unless `path` starts like a safetensors file (8-byte header length, then JSON)."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(9)
    n = struct.unpack("<Q", head[:8])[0] if len(head) >= 8 else -1
    if 0 < n <= min(size - 8, _MAX_HEADER) and head[8:9] == b"{":
        return
    kind = "a pickle / torch.save file" if head[:1] == b"\x80" or head[:4] == b"PK\x03\x04" else "unreadable"
    raise CheckpointError(f"{path} is not a safetensors file ({kind}); re-save the model with "
                          "save_pretrained(DIR), which writes real safetensors")


def check_local_weights(path: Path, allow_pickle: bool, what: str = "model") -> None:
    """Safetensors files must be real; a directory holding only pickle weights is refused unless allowed."""
    safetensors = sorted(path.glob("*.safetensors"))
    for file in safetensors:
        check_safetensors_file(file)
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if safetensors or allow_pickle:
        return
    if pickles:
        raise CheckpointError(
            f"{what} directory {path} holds only pickle weights {pickles}, no model.safetensors; unpickling can run "
            f"arbitrary code, so draftforge refuses it. Re-save it as safetensors (save_pretrained), or if you "
            f"trust the file set {ALLOW_PICKLE_ENV}=1")
    raise CheckpointError(f"{what} directory {path} holds no model weights (*.safetensors)")


def load_causal_lm(source, *, what: str = "model", allow_pickle: bool | None = None, **kwargs):
    """`AutoModelForCausalLM.from_pretrained(source, **kwargs)` after the checks above; CheckpointError on failure."""
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM

    allowed = pickle_allowed(allow_pickle)
    if kwargs.pop("use_safetensors", True) is not True and not allowed:
        raise CheckpointError(f"the {what} loads only safetensors weights unless pickle is allowed explicitly "
                              "(allow_pickle=True): pickle (.bin) files can run code when loaded")
    local = local_model_dir(source, what)
    if local is not None:
        check_local_weights(local, allowed, what)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(local or source), use_safetensors=None if allowed else True,
                                                     **kwargs)
    except (OSError, ValueError, SafetensorError) as err:
        where = (f"{local}" if local is not None else
                 f"{str(source)!r} (no such local directory; tried it as a Hugging Face Hub id)")
        raise CheckpointError(f"cannot load the {what} from {where}: {str(err).splitlines()[0]}") from None
    return model
