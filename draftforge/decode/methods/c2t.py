"""C2T: classifier-pruned dynamic draft trees (C2T §4.2, Alg. 1; docs/methods/c2t.md §5).

Layer by layer up to dmax: every kept frontier node proposes its top-K children; each child gets
C = F(P, H, d) from the trained classifier (models/c2t.py) and survives when C >= β (C = β is kept,
docs/methods/c2t.md §5); optionally a second, global top-K by C over the layer's survivors (same section); only
survivors are expanded, and the whole tree is verified (no N, no rerank). K = 1 is the chain mode,
an early-exit rule: drafting stops at the first token with C < β. Greedy only, like EAGLE-2.

Legend: B frontier nodes at one depth, K children per node, M entropy top-M, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftforge.decode.checks import (check_context, check_dynamic_drafter, draft_vocab_size, non_negative_int,
                                      positive_int)
from draftforge.decode.control import BuilderController
from draftforge.decode.engine import SpeculativeDecoder
from draftforge.decode.methods import Method, MethodOptions, option, register_method
from draftforge.decode.plan import DynamicTree, TreeBuilder
from draftforge.errors import RecipeError
from draftforge.models.c2t import DEPTH_ORIGIN, C2TClassifier, feature_matrix, load_head

DEFAULT_TOP_K, DEFAULT_DEPTH, DEFAULT_BETA = 15, 10, 0.5  # the paper's K, dmax, β (C2T §4.2; docs/methods/c2t.md §5)


def parent_entropy(probs_BV: torch.Tensor, top_m: int, width: int = 0) -> tuple[torch.Tensor, torch.Tensor,
                                                                                 torch.Tensor]:
    """(H_B over each row's top-M probabilities, natural log, not renormalised; the top max(M, width) values_BW and
    ids_BW, for a caller that also needs more children than M)."""
    values_BW, ids_BW = probs_BV.topk(min(max(top_m, width), probs_BV.shape[-1]), dim=-1)
    top_BM = values_BW[:, :top_m]
    entropy_B = -torch.special.xlogy(top_BM, top_BM).sum(-1)  # xlogy: p = 0 gives 0, never NaN
    return entropy_B, values_BW, ids_BW


class C2TBuilder(TreeBuilder):
    """Alg. 1 as a TreeBuilder: expand scores and prunes; every survivor is fed; finish keeps all."""

    def __init__(self, classifier: C2TClassifier, beta: float = DEFAULT_BETA, top_k: int = DEFAULT_TOP_K,
                 max_depth: int = DEFAULT_DEPTH, second_top_k: int | None = None, top_m: int = 1000):
        check_beta(beta)
        self.classifier, self.beta, self.top_k, self.max_depth = classifier, float(beta), top_k, max_depth
        self.second_top_k = top_k if second_top_k is None else second_top_k  # 0: no second pruning
        self.top_m = top_m  # H as the head's harvest computed it (its export's entropy_top_m)

    def scores(self, depth: int, logits_BV: torch.Tensor, joint_B: torch.Tensor):
        """(children ids_BK, C_BK) for the frontier's top-K children."""
        probs_BV = logits_BV.float().softmax(-1)  # the same probabilities dynamic.py multiplies into P
        entropy_B, values_BW, ids_BW = parent_entropy(probs_BV, self.top_m, width=self.top_k)
        p_BK, ids_BK = values_BW[:, : self.top_k], ids_BW[:, : self.top_k]
        joint_BK = joint_B.to(torch.float64)[:, None] * p_BK.double().cpu()
        columns = {"P": joint_BK, "H": entropy_B.cpu()[:, None].expand_as(joint_BK),
                   "d": torch.full_like(joint_BK, depth - 1 + DEPTH_ORIGIN)}
        x_BKF = feature_matrix(columns, self.classifier.features)
        return ids_BK.cpu(), self.classifier.confidence(x_BKF)

    def expand(self, depth: int, logits_BV: torch.Tensor, joint_B: torch.Tensor) -> list[list[int]]:
        ids_BK, conf_BK = self.scores(depth, logits_BV, joint_B)
        keep_BK = conf_BK >= self.beta
        if self.second_top_k and int(keep_BK.sum()) > self.second_top_k:
            flat = torch.where(keep_BK.flatten(), conf_BK.flatten(), torch.tensor(-1.0))
            # stable sort: equal C keeps the earlier (parent rank, child rank) position
            best = torch.sort(flat, descending=True, stable=True).indices[: self.second_top_k]
            keep_BK = torch.zeros_like(keep_BK).flatten().index_fill_(0, best, True).view_as(keep_BK)
        return [ids_K[keep_K].tolist() for ids_K, keep_K in zip(ids_BK, keep_BK)]

    def plan(self) -> DynamicTree:
        return DynamicTree(self, self.max_depth)


def check_beta(beta, flag: str = "--beta") -> float:
    if isinstance(beta, bool) or not isinstance(beta, (int, float)) or not 0.0 < beta < 1.0:
        raise RecipeError(f"{flag} must be in (0, 1) (a threshold on the classifier's confidence), got {beta!r}")
    return float(beta)


@dataclass(frozen=True)
class C2TOptions(MethodOptions):
    c2t: str | None = option(None, "C2T: the exported classifier (task c2t) to prune with")
    beta: float = option(DEFAULT_BETA, f"C2T: keep a node when its confidence C >= β, β in (0, 1) (default "
                         f"{DEFAULT_BETA})", check=check_beta)
    c2t_top_k: int = option(DEFAULT_TOP_K, "C2T: children scored per kept node, K; 1 = chain mode (default "
                            f"{DEFAULT_TOP_K})", check=positive_int)
    c2t_depth: int = option(DEFAULT_DEPTH, f"C2T: draft layers dmax (default {DEFAULT_DEPTH})", check=positive_int)
    c2t_second_top_k: int | None = option(None, "C2T: keep at most this many survivors per layer by C, 0 = off "
                                          "(default: K)", check=non_negative_int)


def make_c2t(target, drafter, o: C2TOptions):
    if o.c2t is None:
        raise RecipeError("method c2t needs a trained classifier (an export of task c2t): --c2t PATH, or the option "
                          "c2t=PATH where methods take options (method_options={'c2t': PATH} in generate())")
    check_dynamic_drafter(drafter, "c2t")
    classifier, meta = load_head(o.c2t)
    vocab = draft_vocab_size(drafter, target)
    if o.c2t_top_k > vocab:
        raise RecipeError(f"--c2t-top-k {o.c2t_top_k} is larger than the drafter's vocabulary ({vocab} tokens)")
    check_context(o.c2t_depth + 1, target, "--c2t-depth")
    builder = C2TBuilder(classifier, o.beta, o.c2t_top_k, o.c2t_depth, o.c2t_second_top_k,
                         int(meta.get("entropy_top_m", 1000)))
    return SpeculativeDecoder("c2t", target, drafter, BuilderController(builder.plan()))


# ---------------------------------------------------------------- the method

register_method(Method("c2t", "C2T: dynamic tree pruned by a classifier on (P, H, d) (--c2t PATH --beta; "
                       "greedy only)", True, make_c2t, C2TOptions, dynamic_trees=True))
