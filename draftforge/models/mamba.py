"""Mamba / Mamba2 drafters as plain `transformers` causal LMs (Mamba Drafters §A.3).

The drafter's vocabulary must equal the target tokenizer's, so `vocab_size` is always an
argument, never a preset value. Presets give the shape; explicit dims in `overrides` win.
"""

from __future__ import annotations

from typing import Any

from transformers import Mamba2Config, Mamba2ForCausalLM, MambaConfig, MambaForCausalLM, PreTrainedModel

from draftforge.errors import RecipeError
from draftforge.loading import note_cpu_kernels
from draftforge.models.student import check_vocab_and_ids, merge_overrides, require_positive_ints

# Shared dims first, then per-architecture extras. Mamba-1 uses a small SSM state (16); Mamba2
# uses a larger state split into heads of `head_dim` channels (Mamba2 paper §7, as in the
# Mamba Drafters setup). "130m" is the papers' drafter size: 24 layers, d_model 768.
# On CPU (no mamba-ssm) prefer "mamba2" for training: transformers' reference Mamba-1 scan
# has a backward pass ~75x slower than Mamba2's chunked scan at 8x256 tokens.
def _preset(hidden: int, layers: int, state2: int, head_dim: int, chunk: int) -> dict:
    return {"hidden_size": hidden, "num_hidden_layers": layers, "expand": 2, "conv_kernel": 4,
            "mamba": {"state_size": 16},
            "mamba2": {"state_size": state2, "head_dim": head_dim, "n_groups": 1, "chunk_size": chunk,
                       "tie_word_embeddings": True}}


MAMBA_PRESETS: dict[str, dict] = {
    "tiny": _preset(128, 2, state2=32, head_dim=32, chunk=64),  # CPU smoke tests and the offline testbed drafter
    "small": _preset(384, 8, state2=64, head_dim=64, chunk=128),
    "130m": _preset(768, 24, state2=128, head_dim=64, chunk=256),
}

_ARCHES = {"mamba": (MambaConfig, MambaForCausalLM), "mamba2": (Mamba2Config, Mamba2ForCausalLM)}
_POSITIVE_INT_FIELDS = ("hidden_size", "num_hidden_layers", "state_size", "expand", "conv_kernel",
                        "head_dim", "n_groups", "num_heads", "chunk_size")


def resolve_mamba_dims(arch: str, size: str | None = "tiny", overrides: dict | None = None) -> dict[str, Any]:
    """Preset dims for `arch` merged with `overrides` (overrides win); validated, num_heads derived."""
    if arch not in _ARCHES:
        raise RecipeError(f"model.arch: unknown Mamba architecture {arch!r}; use one of {sorted(_ARCHES)}")
    dims: dict[str, Any] = {}
    if size is not None:
        if size not in MAMBA_PRESETS:
            raise RecipeError(f"model.size: unknown Mamba preset {size!r}; use one of {sorted(MAMBA_PRESETS)}"
                              " or give explicit dims")
        preset = MAMBA_PRESETS[size]
        dims.update({k: v for k, v in preset.items() if not isinstance(v, dict)})
        dims.update(preset.get(arch, {}))
    merge_overrides(dims, overrides, _ARCHES[arch][0], arch)
    _validate(arch, dims)
    return dims


def _validate(arch: str, dims: dict[str, Any]) -> None:
    require_positive_ints(dims, _POSITIVE_INT_FIELDS)
    if arch != "mamba2":
        return
    hidden, expand = dims.get("hidden_size", 4096), dims.get("expand", 2)
    head_dim, n_groups = dims.get("head_dim", 64), dims.get("n_groups", 8)
    inner = expand * hidden
    if inner % head_dim:
        raise RecipeError(f"model.head_dim: {head_dim} must divide expand*hidden_size = {expand}*{hidden} = {inner}")
    num_heads = inner // head_dim
    if "num_heads" in dims and dims["num_heads"] != num_heads:
        raise RecipeError(f"model.num_heads: {dims['num_heads']} != expand*hidden_size/head_dim = {num_heads};"
                          " drop num_heads (it is derived) or fix head_dim")
    if num_heads % n_groups:
        raise RecipeError(f"model.n_groups: {n_groups} must divide the number of heads ({num_heads})")
    dims["num_heads"] = num_heads


def build_mamba(arch: str, vocab_size: int, *, size: str | None = "tiny", overrides: dict | None = None,
                pad_token_id=None, bos_token_id=None, eos_token_id=None) -> PreTrainedModel:
    """A randomly initialised Mamba ("mamba") or Mamba2 ("mamba2") causal LM over `vocab_size` tokens."""
    special_ids = {"pad_token_id": pad_token_id, "bos_token_id": bos_token_id, "eos_token_id": eos_token_id}
    check_vocab_and_ids(vocab_size, special_ids)
    dims = resolve_mamba_dims(arch, size, overrides)
    config_cls, model_cls = _ARCHES[arch]
    config = config_cls(vocab_size=vocab_size, **special_ids, **dims)
    model = model_cls(config)
    note_cpu_kernels(model)
    return model
