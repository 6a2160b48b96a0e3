"""GGUF -> a standard Hugging Face model directory, through transformers' own GGUF loader.

transformers reads a GGUF file (`from_pretrained(dir, gguf_file=...)`), dequantizing every tensor,
but refuses to `save_pretrained` the result. We rebuild a plain model of the same config, copy the
state dict into it, and write safetensors + config + tokenizer (with its chat template) +
generation config into a temp dir that is renamed into place.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from pathlib import Path

from draftforge.errors import CheckpointError

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
        model = AutoModelForCausalLM.from_pretrained(**where, dtype=dtype or torch.float32)
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


def _apply_umask(tree: Path) -> None:
    """Give `tree` the modes plain mkdir/open would (mkdtemp/mkstemp, used by us and by savers, make 0700/0600).

    The modes come from probes made the plain way, so the process umask is never changed (thread-safe).
    """
    probe_dir, probe_file = tree / ".mode-probe-dir", tree / ".mode-probe-file"
    probe_dir.mkdir()
    probe_file.touch()
    dir_mode, file_mode = probe_dir.stat().st_mode & 0o777, probe_file.stat().st_mode & 0o777
    probe_dir.rmdir()
    probe_file.unlink()
    tree.chmod(dir_mode)
    for root, dirs, files in os.walk(tree):
        for name in dirs:
            os.chmod(os.path.join(root, name), dir_mode)
        for name in files:
            os.chmod(os.path.join(root, name), file_mode)


def replace_dir(tmp_dir: Path, out_dir: Path) -> None:
    """Rename finished `tmp_dir` onto `out_dir`; an existing `out_dir` is moved aside, then removed."""
    if not out_dir.exists():
        tmp_dir.rename(out_dir)
        return
    old_dir = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    shutil.rmtree(old_dir, ignore_errors=True)
    out_dir.rename(old_dir)
    try:
        tmp_dir.rename(out_dir)
    except BaseException:
        old_dir.rename(out_dir)  # put the previous copy back
        raise
    shutil.rmtree(old_dir, ignore_errors=True)


def write_hf_dir(model, tokenizer, out_dir: str | Path, extra_files: dict[str, str] | None = None) -> Path:
    """Save model (safetensors) + tokenizer + extra text files into `out_dir` atomically."""
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        model.save_pretrained(tmp_dir, safe_serialization=True)
        tokenizer.save_pretrained(tmp_dir)
        for name, text in (extra_files or {}).items():
            (tmp_dir / name).write_text(text, encoding="utf-8")
        _apply_umask(tmp_dir)
        replace_dir(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    return out_dir


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
