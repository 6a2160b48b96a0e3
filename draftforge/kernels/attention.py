"""Softmax attention for a few query rows against a long cache, two ways, and a probe that times them on this
machine: `matmul_attention` (float32 matmul, softmax, matmul: the float64 result rounded once to the query's
dtype) and `packed_flash_attention` (torch's fused sdpa kernel with the query heads that share a KV head stacked
as rows of that head, so the cache is neither copied per query head nor masked per head). Which is faster depends
on the CPU: at SmolLM2's shape (9 query heads over 3 KV heads, head dim 64), bf16, 1 thread, per layer and one
query row, the matmul path took 0.11 / 0.75 ms at 1k / 8k keys on an AMD Zen 5 where sdpa took 0.77 / 6.3 ms, and
0.25 / 1.61 ms on an Intel Xeon (AVX512-BF16, no AMX) where the packed flash kernel took 0.08 / 0.65 ms (there
the matmul path still wins at a tree's 34 rows: 7.3 against 10.0 ms at 7.6k keys). draftforge/decode/attention.py
takes the probe's verdict for transformers models and EAGLE-3 heads.

Legend: B batch, H query heads, G query heads per KV head, Q query rows, K keys, D head dim.
"""

from __future__ import annotations

import torch

# Above this many query rows (a prompt, not a decoding step) the float32 score matrix costs Q x K x H x 4 bytes at
# once (for an 8k-token prompt of a 9-head model: 9 x 8k x 8k x 4 B = 2.3 GiB, and the softmax as much again), where
# torch's sdpa works block by block: callers keep sdpa there.
MAX_ROWS = 64

def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding as the Llama family applies it (x·cos + rotate_half(x)·sin): the same tensor
    operations in the same order as transformers' `apply_rotary_pos_emb`, so the results are bitwise its own."""
    half = x.shape[-1] // 2
    return (x * cos) + (torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin)


def matmul_attention(query, key, value, attention_mask, scaling=None, is_causal: bool = True) -> torch.Tensor:
    """Softmax attention in float32 by matmul, softmax, matmul: query [B, H, Q, D], key / value [B, Hkv, K, D],
    mask None (causal over the last Q keys when Q > 1 and `is_causal`), bool (True = visible) or additive, shaped
    [B, 1 or H, Q, >= K]; returns [B, Q, H, D] in the query's dtype."""
    b, h, q, d = query.shape
    hkv, k = key.shape[1], key.shape[2]
    g = h // hkv
    scale = scaling if scaling is not None else d**-0.5
    q_BKgD = query.float().reshape(b, hkv, g * q, d)  # the query heads of one KV head side by side: no repeat_kv
    scores_BKgK = torch.matmul(q_BKgD, key.float().transpose(-1, -2)).mul_(scale)
    scores_BKGQK = scores_BKgK.view(b, hkv, g, q, k)
    if attention_mask is not None:
        mask = attention_mask[..., :k]
        scores = scores_BKGQK
        lead = k - q  # the cached keys before the query rows' own
        if mask.dtype == torch.bool and lead > 0 and bool(mask[..., :lead].all()):
            # a chain's or a tree's mask: every cached key visible, only the last Q columns masked (at 8k keys the
            # full fill was ~7% of a 6-row verification); skipping a fill of nothing changes no bit
            mask, scores, k_masked = mask[..., lead:], scores_BKGQK[..., lead:], q
        else:
            k_masked = k
        mask = mask[:, :, None] if mask.shape[1] == 1 else mask.reshape(b, hkv, g, q, k_masked)
        if mask.dtype == torch.bool:
            scores.masked_fill_(~mask, float("-inf"))
        else:
            scores.add_(mask.float())
    elif q > 1 and is_causal:  # row i sees keys up to K - Q + i: only the last Q columns hold hidden keys
        hidden_QQ = torch.ones(q, q, dtype=torch.bool, device=query.device).triu(1)
        scores_BKGQK[..., k - q:].masked_fill_(hidden_QQ, float("-inf"))
    out_BKgD = torch.matmul(scores_BKgK.softmax(-1), value.float())
    return out_BKgD.view(b, h, q, d).transpose(1, 2).to(query.dtype).contiguous()


def packed_flash_attention(query, key, value, attention_mask, scaling=None, is_causal: bool = True) -> torch.Tensor:
    """The same attention as `matmul_attention` (same arguments, same [B, Q, H, D] result) by torch's fused sdpa
    kernel, with the G query heads of each KV head stacked as G x Q rows of that head (row g·Q + i is head g's
    query i), so neither keys nor values are repeated per query head. Its arithmetic is torch's flash kernel's
    (float32 inside, the probabilities rounded to the input dtype before the product with the values), as
    transformers' own "sdpa" computes it."""
    b, h, q, d = query.shape
    hkv, k = key.shape[1], key.shape[2]
    g = h // hkv
    q_BKgD = query.reshape(b, hkv, g * q, d)
    mask = None
    if attention_mask is not None:
        mask = attention_mask[..., :k]
        if mask.dtype != torch.bool and mask.dtype != query.dtype:
            mask = mask.to(query.dtype)
        # [B, 1, Q, K] -> rows g·Q + i see what query row i sees; per-head masks [B, H, Q, K] regroup by KV head
        mask = mask.repeat(1, 1, g, 1) if mask.shape[1] == 1 else mask.reshape(b, hkv, g * q, k)
    elif q > 1 and is_causal:  # query row i sees keys up to K - Q + i (sdpa's is_causal aligns to the top left)
        mask = torch.arange(k, device=query.device) <= torch.arange(k - q, k, device=query.device)[:, None]
        mask = mask.repeat(g, 1)
    out_BKgD = torch.nn.functional.scaled_dot_product_attention(q_BKgD, key, value, attn_mask=mask, scale=scaling)
    return out_BKgD.view(b, h, q, d).transpose(1, 2).contiguous()


PROBE_ROWS = (1, 2, 4, 8, 16, 32, 64)
PROBE_KEYS = 2048
PROBE_MARGIN = 0.9  # the flash kernel must take < 90% of the matmul path's time: near ties keep the exact rounding


def probe_flash_rows(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype, keys: int = PROBE_KEYS,
                     repeats: int = 5) -> tuple[int, dict[int, tuple[float, float]]]:
    """(the most query rows up to which `packed_flash_attention` beat `matmul_attention` at every probed row
    count, 0 if it lost at one row; {rows: (flash ms, matmul ms)}): both timed here, on random inputs of the
    model's attention shape against `keys` cached keys with a chain's causal mask, median of `repeats` after one
    warm-up, the two alternating, at torch's current thread count."""
    import statistics
    import time

    gen = torch.Generator().manual_seed(0)
    key = torch.randn(1, kv_heads, keys, head_dim, generator=gen).to(dtype)
    value = torch.randn(1, kv_heads, keys, head_dim, generator=gen).to(dtype)
    times, best, winning = {}, 0, True
    with torch.inference_mode():
        for rows in PROBE_ROWS:
            query = torch.randn(1, heads, rows, head_dim, generator=gen).to(dtype)
            runs = {packed_flash_attention: [], matmul_attention: []}
            for i in range(repeats + 1):
                for fn, took in runs.items():
                    start = time.perf_counter()
                    fn(query, key, value, None)
                    if i:
                        took.append(time.perf_counter() - start)
            flash, matmul = (statistics.median(t) * 1e3 for t in runs.values())
            times[rows] = (flash, matmul)
            winning = winning and flash < PROBE_MARGIN * matmul  # at this row count and every smaller one
            if winning:
                best = rows
    return best, times
