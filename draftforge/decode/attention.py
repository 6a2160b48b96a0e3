"""Attention for decoding on CPU in bf16/fp16: a few query rows against a long KV cache, computed in float32 with
plain matrix products, where torch's fused CPU kernel is slow for that shape.

torch's `scaled_dot_product_attention` on CPU (the flash kernel transformers' "sdpa" calls) takes, in bf16, for one
query row of SmolLM2's shape (9 query heads over 3 KV heads, head dim 64), 0.77 ms against 1k cached tokens and
6.3 ms against 8k, per layer; the same attention done as float32 matmul, softmax, matmul takes 0.11 ms and 0.75 ms
with the same error against a float64 reference (it is the float64 result rounded to bf16 once). Over 30 layers
that is most of a decoding step at long context (docs/results/serving.md).

`use_decode_attention(model)` registers this function with transformers' attention interface (masks as for
"sdpa") and switches the model to it: up to `FAST_ROWS` query rows (a decoding step, a verified chain or tree)
take the float32 path; longer inputs (a prompt's prefill) and anything this path does not cover (dropout,
softcap, position bias, attention sinks, fp32 and wider) go to transformers' sdpa unchanged.
`standard_attention(model)` switches back for a block (the self-check's reference forwards use transformers' own
attention, not this code).

Legend: B batch, H query heads, G query heads per KV head, Q query rows, K keys, D head dim.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from draftforge.kernels.attention import MAX_ROWS, matmul_attention

NAME = "draftforge_decode"
FAST_ROWS = MAX_ROWS
FAST_DTYPES = (torch.bfloat16, torch.float16)
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # plain softmax attention, no sinks, softcap or biases
_UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks")


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, is_causal=None,
                     **kwargs):
    """transformers' attention-function signature: query [B, H, Q, D], key / value [B, Hkv, K, D]; returns
    ([B, Q, H, D], None) as "sdpa" does."""
    rows = query.shape[2]
    if (rows > FAST_ROWS or query.dtype not in FAST_DTYPES or dropout or query.device.type != "cpu"
            or any(kwargs.get(name) is not None for name in _UNSUPPORTED)):
        return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                       is_causal=is_causal, **kwargs)
    return matmul_attention(query, key, value, attention_mask, scaling,
                            is_causal if is_causal is not None else getattr(module, "is_causal", True)), None


def _register() -> bool:
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:  # a transformers without the attention interface: nothing to switch
        return False
    ALL_ATTENTION_FUNCTIONS.register(NAME, decode_attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(NAME, sdpa_mask)
    return True


def decode_attention_unavailable(model) -> str | None:
    """Why `model` keeps its attention (None when use_decode_attention applies)."""
    config = model.config
    param = next(model.parameters(), None)
    if config.model_type not in MODEL_TYPES:
        return f"model type {config.model_type!r} (the decode attention covers {', '.join(MODEL_TYPES)})"
    if getattr(config, "_attn_implementation", None) != "sdpa":
        return f"attention {getattr(config, '_attn_implementation', None)!r} (the decode attention replaces sdpa)"
    if param is None or param.device.type != "cpu" or param.dtype not in FAST_DTYPES:
        return "not a CPU bf16/fp16 model"
    return None


def use_decode_attention(model) -> str:
    """Switch `model` to the decode attention where it applies; returns what was done, in words."""
    why = decode_attention_unavailable(model)
    if why is not None:
        return f"attention left as it is: {why}"
    if not _register():
        return "attention left as it is: this transformers has no attention interface"
    model.config._attn_implementation = NAME
    return f"attention: {NAME} for up to {FAST_ROWS} query rows (float32 matmul-softmax), sdpa beyond"


@contextmanager
def standard_attention(model):
    """Within the block, `model` computes attention with transformers' sdpa (no-op for any other model)."""
    config = getattr(model, "config", None)
    before = getattr(config, "_attn_implementation", None)
    if before != NAME:
        yield
        return
    config._attn_implementation = "sdpa"
    try:
        yield
    finally:
        config._attn_implementation = before
