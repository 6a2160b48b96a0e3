"""Attention for decoding on CPU in bf16/fp16: a few query rows against a long KV cache, by whichever of two kernels
(draftforge/kernels/attention.py) a probe finds faster on this machine, where transformers' "sdpa" path is slow
for that shape.

transformers' sdpa, given a mask (a verified chain or tree), repeats the keys and values for every query head
(repeat_kv) before torch's fused kernel: at 8k keys of SmolLM2 (9 query heads over 3 KV heads) that is 3x the
layer's cache copied per layer and forward. The two kernels here never copy the cache per head: the float32
matmul-softmax-matmul path (the float64 result rounded once; it converts the cache to float32 each call) and
torch's flash kernel with each KV head's query heads stacked as rows. Per layer, one query row, bf16, 1 thread:
on an AMD Zen 5 the matmul path took 0.11 / 0.75 ms at 1k / 8k keys where sdpa took 0.77 / 6.3 ms; on an Intel
Xeon (AVX512-BF16, AMX hidden) the packed flash kernel took 0.08 / 0.65 ms where the matmul path took
0.25 / 1.61 ms (docs/results/long-context.md). So `use_decode_attention(model)` times both at the model's
attention shape (`probe_flash_rows`: 1 to 64 rows against 2,048 keys, ~0.2 s) and routes up to the probed row
count to the flash kernel, up to `FAST_ROWS` to the matmul path; `DRAFTFORGE_FLASH_ROWS=N` fixes the count
instead (0: matmul only, as before the probe). The probe runs once per process and attention shape (every model
loaded in one process computes alike); another process may choose differently where the two kernels nearly tie.
The choice is stored on each attention module (`draftforge_flash_rows`) and named in
`model.draftforge_attention`. Longer inputs (a prompt's prefill) and anything these paths do not cover (dropout,
softcap, position bias, attention sinks, fp32 and wider) go to transformers' sdpa unchanged.
`standard_attention(model)` switches back for a block (the self-check's reference forwards use transformers' own
attention, not this code).

Legend: B batch, H query heads, G query heads per KV head, Q query rows, K keys, D head dim.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import torch

from draftforge.errors import RecipeError
from draftforge.kernels.attention import (MAX_ROWS, PROBE_KEYS, matmul_attention, packed_flash_attention,
                                          probe_flash_rows)

NAME = "draftforge_decode"
FAST_ROWS = MAX_ROWS
FAST_DTYPES = (torch.bfloat16, torch.float16)
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # plain softmax attention, no sinks, softcap or biases
_UNSUPPORTED = ("softcap", "position_bias", "s_aux", "sinks")
FLASH_ROWS_ENV = "DRAFTFORGE_FLASH_ROWS"
_PROBED: dict[tuple, tuple[int, str]] = {}  # (heads, kv heads, head dim, dtype, threads) -> choose_flash_rows' answer


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
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    kernel = packed_flash_attention if rows <= getattr(module, "draftforge_flash_rows", 0) else matmul_attention
    return kernel(query, key, value, attention_mask, scaling, causal), None


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


def _fixed_flash_rows() -> int | None:
    """DRAFTFORGE_FLASH_ROWS as a row count (None when unset)."""
    text = os.environ.get(FLASH_ROWS_ENV, "").strip()
    if not text:
        return None
    if not text.isdigit():
        raise RecipeError(f"{FLASH_ROWS_ENV} must be a number of query rows (0 to {FAST_ROWS}), got {text!r}")
    return min(int(text), FAST_ROWS)


def choose_flash_rows(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                      flash_rows: int | None = None) -> tuple[int, str]:
    """(query rows up to which the packed flash kernel runs, how that was decided in words): `flash_rows` if
    given, else DRAFTFORGE_FLASH_ROWS if set, else the probe's verdict for this attention shape."""
    if flash_rows is not None:
        return flash_rows, "given"
    fixed = _fixed_flash_rows()
    if fixed is not None:
        return fixed, f"set by {FLASH_ROWS_ENV}"
    key = (heads, kv_heads, head_dim, dtype, torch.get_num_threads())
    if key not in _PROBED:  # once per process and shape: every model loaded here computes alike
        flash_rows, times = probe_flash_rows(heads, kv_heads, head_dim, dtype)
        one = times[1]
        _PROBED[key] = flash_rows, (f"probed at {PROBE_KEYS} keys, {key[-1]} thread(s): one row {one[0]:.2f} ms "
                                    f"flash vs {one[1]:.2f} ms matmul per layer")
    return _PROBED[key]


def use_decode_attention(model, flash_rows: int | None = None) -> str:
    """Switch `model` to the decode attention where it applies; returns what was done, in words. flash_rows:
    query rows up to which the packed flash kernel runs (None: DRAFTFORGE_FLASH_ROWS if set, else the probe's)."""
    why = decode_attention_unavailable(model)
    if why is not None:
        return f"attention left as it is: {why}"
    if not _register():
        return "attention left as it is: this transformers has no attention interface"
    config = model.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    flash_rows, how = choose_flash_rows(heads, getattr(config, "num_key_value_heads", None) or heads, head_dim,
                                        next(model.parameters()).dtype, flash_rows)
    for module in model.modules():
        if hasattr(module, "num_key_value_groups"):  # the Llama family's attention modules
            module.draftforge_flash_rows = flash_rows
    config._attn_implementation = NAME
    flash = (f"torch's flash kernel (query heads packed per KV head) up to {flash_rows} query rows, "
             if flash_rows else "")
    return f"attention: {NAME}: {flash}float32 matmul-softmax up to {FAST_ROWS}, sdpa beyond ({how})"


def use_head_attention(head) -> str | None:
    """An EAGLE-3 head (models/eagle3.py) on CPU in bf16/fp16: its decoding steps take the packed flash kernel up
    to the rows `choose_flash_rows` gives for its attention shape (the float32 matmul path above); what was done,
    in words, also in `head.draftforge_attention` (None: any other device or dtype, where it keeps its kernels)."""
    weight = head.fc.weight
    if weight.device.type != "cpu" or weight.dtype not in FAST_DTYPES:
        return None
    c = head.config
    rows, how = choose_flash_rows(c.num_attention_heads, c.num_key_value_heads, c.head_dim, weight.dtype)
    head.draftforge_flash_rows = rows
    kernels = f"packed flash kernel up to {rows} query rows, float32 matmul above" if rows else "float32 matmul"
    head.draftforge_attention = f"{kernels} ({how})"
    return head.draftforge_attention


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
