"""Any small Hugging Face causal LM as a student: Transformer baselines and the testbed's tiny target."""

from __future__ import annotations

from typing import Any

from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from draftforge.errors import RecipeError

# Llama-style shapes. "tiny-target" is the offline testbed's target: deep and wide enough
# that one cached decode step costs clearly more than the 2-layer "tiny" Mamba drafter's
# (so speculative decoding can win even on CPU), yet small enough to pre-train on 2 CPU
# cores in a few minutes. "tiny-drafter" is the Transformer baseline with about the
# parameter count of the tiny Mamba drafter (tests check the ratio).
LLAMA_PRESETS: dict[str, dict] = {
    "tiny-target": {
        "hidden_size": 256, "num_hidden_layers": 6, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 768, "max_position_embeddings": 512, "tie_word_embeddings": True,
    },
    "tiny-drafter": {
        "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4,
        "intermediate_size": 256, "max_position_embeddings": 512, "tie_word_embeddings": True,
    },
    "small": {
        "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8, "num_key_value_heads": 8,
        "intermediate_size": 1536, "max_position_embeddings": 2048, "tie_word_embeddings": True,
    },
}


def merge_overrides(dims: dict[str, Any], overrides: dict | None, config_cls, arch: str) -> None:
    """Copy recipe `model.overrides` into `dims`; RecipeError naming a key `config_cls` has no field for."""
    known = set(config_cls().to_dict())
    for key, value in (overrides or {}).items():
        if key not in known or key == "vocab_size":
            hint = "vocab_size comes from the tokenizer" if key == "vocab_size" else f"not a {config_cls.__name__} field"
            raise RecipeError(f"model.{key}: cannot set this for arch {arch!r} ({hint})")
        dims[key] = value


def require_positive_ints(dims: dict[str, Any], keys) -> None:
    """RecipeError naming the first of `keys` in `dims` that is not a positive integer (bools are not)."""
    for key in keys:
        if key in dims and (not isinstance(dims[key], int) or isinstance(dims[key], bool) or dims[key] <= 0):
            raise RecipeError(f"model.{key}: must be a positive integer, got {dims[key]!r}")


def check_vocab_and_ids(vocab_size, special_ids: dict) -> None:
    """RecipeError unless vocab_size is a positive int and every given special token id is inside it."""
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size <= 0:
        raise RecipeError(f"vocab_size: must be a positive integer (the tokenizer's size), got {vocab_size!r}")
    for name, token_id in special_ids.items():
        if token_id is not None and not 0 <= token_id < vocab_size:
            raise RecipeError(f"{name}: {token_id} is outside the vocabulary (size {vocab_size})")


def _config_class(arch: str):
    try:
        return type(AutoConfig.for_model(arch))
    except ValueError:
        raise RecipeError(f"model.arch: {arch!r} is not a model type transformers knows "
                          "(e.g. llama, qwen2, mistral, mamba, mamba2)") from None


def resolve_causal_lm_config(arch: str, vocab_size: int, *, size: str | None = None, overrides: dict | None = None,
                             max_position_embeddings: int | None = None, **special_ids):
    """The config for `arch`: preset, then explicit overrides (they win), then vocab and special ids."""
    check_vocab_and_ids(vocab_size, special_ids)
    config_cls = _config_class(arch)
    dims: dict[str, Any] = {}
    if size is not None:
        if size not in LLAMA_PRESETS:
            raise RecipeError(f"model.size: unknown preset {size!r}; use one of {sorted(LLAMA_PRESETS)}")
        known = set(config_cls().to_dict())
        dims.update({k: v for k, v in LLAMA_PRESETS[size].items() if k in known})
    merge_overrides(dims, overrides, config_cls, arch)
    if max_position_embeddings is not None:
        dims["max_position_embeddings"] = max_position_embeddings
    dims.update(special_ids)
    _validate_attention(dims)
    return config_cls(vocab_size=vocab_size, **dims)


def _validate_attention(dims: dict[str, Any]) -> None:
    require_positive_ints(dims, ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                                 "intermediate_size", "max_position_embeddings"))
    hidden, heads = dims.get("hidden_size"), dims.get("num_attention_heads")
    if hidden and heads and dims.get("head_dim") is None and hidden % heads:
        raise RecipeError(f"model.num_attention_heads: {heads} must divide hidden_size ({hidden})")
    kv_heads = dims.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise RecipeError(f"model.num_key_value_heads: {kv_heads} must divide num_attention_heads ({heads})")


def build_causal_lm(arch: str, vocab_size: int, *, size: str | None = None, overrides: dict | None = None,
                    max_position_embeddings: int | None = None, pad_token_id=None, bos_token_id=None,
                    eos_token_id=None) -> PreTrainedModel:
    """A randomly initialised causal LM of model type `arch` ("llama", "qwen2", ...)."""
    config = resolve_causal_lm_config(arch, vocab_size, size=size, overrides=overrides,
                                      max_position_embeddings=max_position_embeddings, pad_token_id=pad_token_id,
                                      bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    try:
        return AutoModelForCausalLM.from_config(config)
    except ValueError as err:  # model types without a causal-LM head (e.g. "bert" encoders)
        raise RecipeError(f"model.arch: {arch!r} has no causal-LM class in transformers ({err})") from None


def load_pretrained(path_or_id, **kwargs) -> PreTrainedModel:
    """A causal LM from a local dir or Hub id through `draftforge.loading.load_causal_lm` (safetensors only)."""
    from draftforge.loading import load_causal_lm

    return load_causal_lm(path_or_id, what="model.init_from", **kwargs)
