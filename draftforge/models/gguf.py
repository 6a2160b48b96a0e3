"""GGUF -> a standard Hugging Face model directory, through transformers' own GGUF loader.

transformers reads a GGUF file (`from_pretrained(dir, gguf_file=...)`), dequantizing every tensor,
but refuses to `save_pretrained` the result. We rebuild a plain model of the same config, copy the
state dict into it, and write safetensors + config + tokenizer (with its chat template) +
generation config into a temp dir that is renamed into place.
"""

from __future__ import annotations

import struct
from pathlib import Path

from draftforge.errors import CheckpointError
from draftforge.hfcompat import NO_HUB_KERNELS

# transformers reads these GGUF architectures as something other than a causal LM (or not at all here).
_NOT_CAUSAL = {"general", "tokenizer", "t5", "umt5"}
_READ_ERRORS = (ValueError, IndexError, KeyError, OSError, EOFError, struct.error, NotImplementedError)


def supported_architectures() -> list[str]:
    """GGUF `general.architecture` values that transformers loads as a causal LM."""
    try:
        from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES
    except ImportError:  # older/newer layout: llama is what draftforge uses and tests
        return ["llama"]
    return sorted(a for a in GGUF_SUPPORTED_ARCHITECTURES if a not in _NOT_CAUSAL)


def _gguf_module():
    try:
        import gguf
    except ImportError:
        raise CheckpointError("reading a GGUF file needs the 'gguf' package: pip install gguf") from None
    return gguf


def gguf_architecture(path: str | Path) -> str:
    """The file's `general.architecture`; CheckpointError if it is missing, not GGUF, or truncated."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"GGUF file {path} does not exist")
    try:
        reader = _gguf_module().GGUFReader(str(path))
        field = reader.fields["general.architecture"]
        arch = field.contents() if hasattr(field, "contents") else bytes(field.parts[-1]).decode()
    except KeyError:
        raise CheckpointError(f"{path} has no 'general.architecture' key; it is not a model GGUF") from None
    except _READ_ERRORS as e:
        raise CheckpointError(f"{path} is not a readable GGUF file (corrupt or truncated?): "
                              f"{type(e).__name__}: {e}") from None
    return str(arch)


def check_gguf(path: str | Path) -> str:
    """Read the header and refuse an architecture draftforge cannot convert; returns the architecture."""
    arch = gguf_architecture(path)
    supported = supported_architectures()
    if arch not in supported:
        raise CheckpointError(f"{path}: GGUF architecture {arch!r} is not supported; "
                              f"supported (causal LMs transformers can read): {', '.join(supported)}")
    return arch


def load_gguf(path: str | Path, dtype=None):
    """(model, tokenizer) as transformers' GGUF loader gives them, weights dequantized to `dtype` (fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    check_gguf(path)
    where = dict(pretrained_model_name_or_path=str(path.parent), gguf_file=path.name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(**where)
    except _READ_ERRORS as e:
        raise CheckpointError(f"{path}: cannot build a tokenizer from the GGUF metadata: "
                              f"{type(e).__name__}: {e}") from None
    try:
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype or torch.float32, **NO_HUB_KERNELS)
    except _READ_ERRORS as e:
        raise CheckpointError(f"{path}: transformers could not load the GGUF weights (corrupt or truncated?): "
                              f"{type(e).__name__}: {e}") from None
    return model.eval(), tokenizer


def plain_copy(gguf_model):
    """A plain (saveable) model of the same class and config holding the GGUF model's dequantized weights."""
    config = gguf_model.config.__class__.from_dict(gguf_model.config.to_dict())
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    dtype = next(gguf_model.parameters()).dtype
    model = gguf_model.__class__(config).to(dtype)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # tied heads appear as "missing" in some versions; anything else means the copy is wrong
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"rebuilding the GGUF model lost weights: missing {missing[:5]}, "
                              f"unexpected {unexpected[:5]}")
    model.tie_weights()
    model.generation_config = gguf_model.generation_config
    return model.eval()


def write_hf_dir(model, tokenizer, out_dir: str | Path, extra_files: dict[str, str] | None = None) -> Path:
    """Save model (safetensors) + tokenizer + extra text files into `out_dir` atomically."""
    from draftforge.export import write_model_dir

    return write_model_dir(model, tokenizer, Path(out_dir), extra_files)


def convert_gguf(gguf_path: str | Path, out_dir: str | Path, *, dtype=None,
                 extra_files: dict[str, str] | None = None, log=None):
    """Convert a GGUF file into a standard HF directory at `out_dir`; returns (out_dir, plain model, tokenizer)."""
    log = log or (lambda msg: None)
    log(f"reading {gguf_path} with transformers' GGUF loader (dequantizing)")
    gguf_model, tokenizer = load_gguf(gguf_path, dtype)
    model = plain_copy(gguf_model)
    del gguf_model
    log(f"writing {out_dir}")
    return write_hf_dir(model, tokenizer, out_dir, extra_files), model, tokenizer
