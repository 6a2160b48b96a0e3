"""Token distributions shared by target and drafter, so both see the same warping.

Legend: V vocabulary, N rows (tree nodes or batch).
Temperature 0 means greedy; then distributions are not needed and only argmax is used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from draftforge.errors import DraftforgeError


TREE_DRAWS = ("distinct", "iid")  # how a tree's sibling drafts are drawn at T > 0
# Below this temperature logits / T can overflow float32 (inf - inf in the softmax: NaN rows, drawn as token 0);
# softmax(logits / T) is then its T -> 0 limit to the last bit: an even share of the top logits
TINY_TEMPERATURE = 1e-20


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    tree_draws: Literal["distinct", "iid"] = "distinct"  # T>0 siblings: without replacement, or with

    def __post_init__(self):
        if not self.temperature >= 0.0:
            raise DraftforgeError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 <= self.top_p <= 1.0:  # 0: only the most likely token (the last of a tie, as transformers)
            raise DraftforgeError(f"top_p must be in [0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise DraftforgeError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if self.tree_draws not in TREE_DRAWS:
            raise DraftforgeError(f"tree_draws must be one of {', '.join(TREE_DRAWS)}, got {self.tree_draws!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs_from_logits(logits_NV: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(logits / T) after top-k then top-p filtering (HF order); float32 or wider."""
    if params.greedy:
        raise ValueError("probs_from_logits is for temperature > 0")
    dtype = torch.float64 if logits_NV.dtype == torch.float64 else torch.float32
    logits_NV = logits_NV.to(dtype)
    if params.temperature < TINY_TEMPERATURE:
        top_NV = logits_NV == logits_NV.amax(-1, keepdim=True)
        logits_NV = torch.zeros_like(logits_NV).masked_fill(~top_NV, float("-inf"))
    else:
        logits_NV = logits_NV / params.temperature
    if params.top_k > 0 and params.top_k < logits_NV.shape[-1]:
        kth_N1 = torch.topk(logits_NV, params.top_k, dim=-1).values[..., -1:]
        logits_NV = logits_NV.masked_fill(logits_NV < kth_N1, float("-inf"))
    if params.top_p < 1.0:
        # transformers' TopPLogitsWarper step for step (ascending sort, drop while the mass up to and including a
        # token is <= 1 - top_p, keep the last): a descending formulation kept another of two tied tokens at the
        # cut (common in bf16), so speculative_generate sampled another distribution than generate() there
        sorted_NV, order_NV = torch.sort(logits_NV, dim=-1, descending=False)
        drop_sorted_NV = sorted_NV.softmax(-1).cumsum(-1) <= (1 - params.top_p)
        drop_sorted_NV[..., -1:] = False
        drop_NV = drop_sorted_NV.scatter(-1, order_NV, drop_sorted_NV)
        logits_NV = logits_NV.masked_fill(drop_NV, float("-inf"))
    return logits_NV.softmax(-1)


def sample(probs_NV: torch.Tensor, generator: torch.Generator, num: int = 1, distinct: bool = False) -> torch.Tensor:
    """num draws per row: i.i.d. (with replacement), or `distinct`: without replacement, in draw order (the k-th
    is drawn from probs with the first k-1 removed and renormalised). A row with fewer than num tokens of
    nonzero probability repeats its last draw in the spare slots; the tree verifier skips a token it has
    already tried among siblings, so those slots are never accepted."""
    if not distinct or num == 1:  # one draw is the same either way
        return draw_iid(probs_NV, generator, num)
    left_NV, draws = probs_NV.clone(), []
    for k in range(num):
        if k:
            spent_N = left_NV.sum(-1) <= 0
            if bool(spent_N.any()):  # every token of nonzero probability drawn: repeat the last one
                left_NV[spent_N] = left_NV[spent_N].scatter(-1, draws[-1][spent_N], 1.0)
        draws.append(draw_one(left_NV, generator))
        left_NV.scatter_(-1, draws[-1], 0.0)
    return torch.cat(draws, -1)


def draw_one(weights_NV: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """One draw per row of unnormalised nonnegative weights, as [N, 1] indices, by inverse CDF: every draw of the
    decoder (drafts, corrections, bonus tokens, AR at T > 0) comes here. (torch.multinomial with one sample draws
    an exponential per vocabulary entry: 1.2 ms for one row of 49,152 on one quiet thread, against 0.06 ms here.)
    The CDF is summed in float64, so a token's share of it is its weight to ~1e-16 (a float32 running sum over
    49k entries would round every step by up to half a float32 ulp of the total). A token of zero weight is never
    drawn: searchsorted on the right side skips flat stretches of the CDF, and a u that rounds up to the total
    takes the last token of nonzero weight."""
    return draw_iid(weights_NV, generator, 1)


def draw_iid(weights_NV: torch.Tensor, generator: torch.Generator, num: int) -> torch.Tensor:
    """num i.i.d. draws per row as [N, num] indices, as `draw_one` draws them (num of its calls in a row give the
    same tokens from the same generator), with the row's CDF summed once instead of num times."""
    cdf_NV = weights_NV.to(torch.float64).cumsum(-1)
    total_N1, last_N1 = cdf_NV[:, -1:], None
    draws = []
    for _ in range(num):
        u_N1 = torch.rand((cdf_NV.shape[0], 1), generator=generator, dtype=cdf_NV.dtype, device=cdf_NV.device)
        idx_N1 = torch.searchsorted(cdf_NV, u_N1 * total_N1, right=True)
        past_N1 = idx_N1 >= cdf_NV.shape[-1]
        if bool(past_N1.any()):
            if last_N1 is None:  # first index of the running max: the last token of nonzero weight
                last_N1 = (weights_NV > 0).long().cumsum(-1).argmax(-1, keepdim=True)
            idx_N1 = torch.where(past_N1, last_N1, idx_N1)
        draws.append(idx_N1)
    return draws[0] if num == 1 else torch.cat(draws, -1)


def match_vocab(logits_NV: torch.Tensor, vocab: int, d2t=None) -> torch.Tensor:
    """Drafter logits over the target's vocabulary: a reduced draft head's are scattered by its d2t map
    (-inf elsewhere); a full head's are cut or -inf-padded (padded embedding rows differ)."""
    if d2t is not None:
        from draftforge.models.draft_vocab import to_target_logits

        return to_target_logits(logits_NV, d2t, vocab)
    width = logits_NV.shape[-1]
    if width == vocab:
        return logits_NV
    if width > vocab:
        return logits_NV[..., :vocab]
    pad = logits_NV.new_full((*logits_NV.shape[:-1], vocab - width), float("-inf"))
    return torch.cat([logits_NV, pad], dim=-1)
