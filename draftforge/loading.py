"""One safe way to load a causal LM, and one place that quiets notices a user cannot act on.

`load_causal_lm` checks a local path before transformers sees it (a missing directory says so,
instead of the Hub's "Repo id must be in the form ..."), loads safetensors only (pickle weights
can run code when unpickled; opt in with `allow_pickle=True` or DRAFTFORGE_ALLOW_PICKLE=1), and
turns a file named `.safetensors` that is not one into a CheckpointError. A reduced-vocabulary draft head
(models/draft_vocab.py), which does not fit config.vocab_size, is put back after transformers loads the rest.
"""

from __future__ import annotations

import contextlib

import importlib.util
import logging
import os
import re
import struct
import sys
from pathlib import Path

from draftforge.errors import CheckpointError, RecipeError, first_line
from draftforge.hfcompat import NO_HUB_KERNELS

ALLOW_PICKLE_ENV = "DRAFTFORGE_ALLOW_PICKLE"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
# "name" or "org/name": what the Hub accepts; anything else that does not exist is a missing local path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")
_MAX_HEADER = 100 * 2**20  # safetensors caps its JSON header at 100 MB
DRAFT_VOCAB_KEY = "draft_vocab"  # config key of a reduced head's draft -> target id map (models/draft_vocab.py)


def pickle_allowed(allow_pickle: bool | None = None) -> bool:
    """An explicit argument wins; otherwise DRAFTFORGE_ALLOW_PICKLE=1 (the CLI's opt-in)."""
    if allow_pickle is not None:
        return allow_pickle
    return os.environ.get(ALLOW_PICKLE_ENV, "").strip().lower() in ("1", "true", "yes")


def org_is_local_folder(text: str) -> bool:
    """Whether `text` is "org/name" with `org` a folder here: runs/nope beside runs/ is a mistyped local path, not a
    Hub repository or dataset (read as one it cost half a minute or more of retries without the Hub, then a Hub
    error). Shared by the model loaders (hub_id) and the data sources (data/sources.py is_hf_name)."""
    org, slash, _ = str(text).partition("/")
    return bool(slash) and Path(org).expanduser().is_dir()


def hub_id(source) -> bool:
    """Whether `source`, naming nothing here, is read as a Hugging Face Hub id: a str shaped "name" or "org/name"
    whose org is not a local folder."""
    text = str(source)
    return not isinstance(source, Path) and bool(_HUB_ID.match(text)) and not org_is_local_folder(text)


def missing_local_path(source) -> Path | None:
    """`source` as a Path when it names a local path that does not exist (and is no Hub id), else None."""
    path = Path(str(source)).expanduser()
    if path.exists() or hub_id(source):
        return None
    return path


def _named(key: str) -> str:
    """How an error names where a path came from: a command-line flag as itself, else the recipe key."""
    return key if key.startswith("--") else f"recipe key '{key}'"


def check_local(source: str, key: str) -> str:
    """`source`, or RecipeError naming `key` (a recipe key, or a flag such as --target) when it is a local path
    that does not exist (not the Hub's "Repo id must be in the form ..." that transformers says about it)."""
    missing = missing_local_path(source)
    if missing is not None:
        raise RecipeError(f"{_named(key)}: directory {missing} does not exist")
    return source


def load_config(path: str, key: str):
    """A transformers config from `path`, or RecipeError naming the recipe key that points there."""
    from transformers import AutoConfig

    check_local(path, key)
    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        first = first_line(e)
        where = (f"{path!r}" if Path(str(path)).expanduser().exists() else
                 f"{path!r} (no such local directory; tried it as a Hugging Face Hub id)")
        raise RecipeError(f"{_named(key)}: cannot read a model config from {where}: {first}") from None


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
    if not hub_id(source):
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
    quiet_known_notices()
    kwargs = {**NO_HUB_KERNELS, **kwargs}
    if local is not None:  # a reduced draft head does not fit config.vocab_size: put back after loading
        kwargs.update(reduced_head_kwargs(local))
    try:
        # A reduced draft head is expected not to fit config.vocab_size: transformers' load report would call it
        # a MISMATCH and "reinit"; restore_reduced_head puts the trained head back, so that report is muted.
        with _quiet_load_report(kwargs.get("ignore_mismatched_sizes", False)):
            model = AutoModelForCausalLM.from_pretrained(str(local or source),
                                                         use_safetensors=None if allowed else True, **kwargs)
        if local is not None:
            restore_reduced_head(model, local)
    except (OSError, ValueError, SafetensorError) as err:
        where = (f"{local}" if local is not None else
                 f"{str(source)!r} (no such local directory; tried it as a Hugging Face Hub id)")
        raise CheckpointError(f"cannot load the {what} from {where}: {first_line(err)}") from None
    note_cpu_kernels(model)
    return model


def read_tokenizer(path, what: str):
    """The tokenizer saved in `path`, None where it holds no tokenizer files (ids are then used unchecked);
    CheckpointError for tokenizer files that cannot be read (taken for none, a drafter's vocabulary would go
    unchecked against its target's)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as err:
        where = Path(str(path)).expanduser()
        damaged = [n for n in ("tokenizer.json", "tokenizer_config.json") if (where / n).is_file()]
        if not damaged:
            return None
        raise CheckpointError(f"the {what}'s tokenizer in {where} cannot be read ({first_line(err)}); re-export it, "
                              f"or remove its {' and '.join(damaged)} to use token ids unchecked") from None


def reduced_head_kwargs(path) -> dict:
    """Extra from_pretrained arguments for a reduced-vocabulary checkpoint (its head does not fit the
    config's vocab_size; restore_reduced_head puts it back afterwards)."""
    config = Path(str(path)) / "config.json"
    if config.is_file() and DRAFT_VOCAB_KEY in config.read_text():
        import json

        if json.loads(config.read_text()).get(DRAFT_VOCAB_KEY) is not None:
            return {"ignore_mismatched_sizes": True}
    return {}


def restore_reduced_head(model, path) -> None:
    """After `from_pretrained(..., ignore_mismatched_sizes=True)` of a reduced-vocabulary checkpoint: put
    back its trained N-row head (from_pretrained re-initialised a full one)."""
    d2t = getattr(model.config, DRAFT_VOCAB_KEY, None)
    if d2t is None:
        return
    import torch
    from safetensors import safe_open

    files = sorted(Path(path).glob("*.safetensors"))
    for f in files:
        with safe_open(str(f), framework="pt") as st:
            name = next((k for k in st.keys() if k.endswith("lm_head.weight")), None)
            if name is not None:
                weight = st.get_tensor(name)
                break
    else:
        raise CheckpointError(f"{path}: a reduced-vocabulary drafter ({len(d2t)} draft ids) but no lm_head.weight "
                              "in its safetensors files")
    if weight.shape[0] != len(d2t):
        raise CheckpointError(f"{path}: lm_head has {weight.shape[0]} rows but config.draft_vocab lists {len(d2t)}")
    dtype = model.get_input_embeddings().weight.dtype
    head = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, dtype=dtype)
    with torch.no_grad():
        head.weight.copy_(weight.to(dtype))
    model.set_output_embeddings(head.to(model.get_input_embeddings().weight.device))


@contextlib.contextmanager
def _quiet_load_report(quiet: bool):
    """Drop transformers' loading report (a warning on the modeling_utils logger) while `quiet`; its other
    messages pass (a level change would not do: transformers runs extra checks when that level is raised)."""
    if not quiet:
        yield
        return
    report_logger = logging.getLogger("transformers.modeling_utils")
    drop = _DropLoadReport()
    report_logger.addFilter(drop)
    try:
        yield
    finally:
        report_logger.removeFilter(drop)


class _DropLoadReport(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in str(record.msg)


# ---- notices -----------------------------------------------------------------------------------------

# (logger, text in the record) pairs that are dropped: transformers' advice to install the CUDA-only
# mamba-ssm / causal-conv1d kernels (once per kernel function), DeepSpeed's CPU-accelerator warning,
# and Accelerate's note that a tied lm_head is saved once (tied embeddings are the presets' default).
_QUIET = (
    ("transformers.integrations.hub_kernels", "is falling back to its reference PyTorch implementation"),
    ("transformers.models.mamba.modeling_mamba", "fast path is not available"),
    ("transformers.models.mamba2.modeling_mamba2", "fast path is not available"),
    ("DeepSpeed", "Setting accelerator to CPU"),
    ("accelerate.utils.other", "Removed shared tensor {'lm_head.weight'} while saving"),
    # transformers' assisted generation (5.25) calls the assistant's generate() with both, on every run
    ("transformers.generation.utils", "Passing `generation_config` together with generation-related arguments"),
)
_state = {"quiet": False, "noted": False}
# Model types whose layers call the mamba-ssm / causal-conv1d kernels when they are installed.
_SSM_TYPES = ("mamba", "bamba", "jamba", "zamba", "nemotron_h", "granitemoehybrid", "falcon_h1")


class _DropText(logging.Filter):
    def __init__(self, text: str):
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_known_notices() -> None:
    """Drop the notices listed in _QUIET (once per process; the loggers need not exist yet)."""
    if _state["quiet"]:
        return
    for name, text in _QUIET:
        logging.getLogger(name).addFilter(_DropText(text))
    # transformers' "Loading weights" / "Writing model shards" bars: the commands say what they load and save in
    # their own words (read once at transformers' import; unless the user set it)
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules and os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] == "1":
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    _state["quiet"] = True


def note_cpu_kernels(model) -> None:
    """Say once per process, in our words, that Mamba layers run without their CUDA kernels (and why)."""
    quiet_known_notices()
    model_type = getattr(getattr(model, "config", None), "model_type", "") or ""
    if _state["noted"] or not any(t in model_type for t in _SSM_TYPES) or os.environ.get("RANK", "0") != "0":
        return
    _state["noted"] = True
    import torch

    if not torch.cuda.is_available():
        line = "CPU: Mamba layers run transformers' PyTorch path (the mamba-ssm / causal-conv1d kernels need CUDA)"
    elif importlib.util.find_spec("mamba_ssm") is None:
        line = ("Mamba layers run transformers' PyTorch path: the mamba-ssm kernels are not installed "
                "(pip install 'draftforge[gpu]')")
    else:
        return
    print(f"[draftforge] {line}", file=sys.stderr)
