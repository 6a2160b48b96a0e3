"""Softmax attention for a few query rows against a long cache, as float32 matmul, softmax, matmul: on CPU in
bf16 several times faster than torch's fused sdpa kernel for that shape (draftforge/decode/attention.py, where
transformers models get it; the EAGLE-3 head's decoding step uses it directly).

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
