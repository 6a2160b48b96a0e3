"""EAGLE-2 dynamic draft trees for any drafter with the node interface (C2T paper §2.2; docs/methods/c2t.md §2).

Expand: at every draft layer each frontier node proposes its top-k children by drafter probability;
the global top-k of all new children by joint probability P (product of p along the root path)
become the next frontier. Layer 1 is the root's top-k, then `depth` more layers, so the pool T1
holds k + depth·k² nodes (paper dmax = EAGLE code `depth` + 1). Rerank: the top (total_tokens - 1)
nodes of T1 by P (total_tokens counts the root, as EAGLE's `total_token` does) are verified in one
target forward. They always form a valid subtree since P(child) <= P(parent); ties are broken by
creation order, which puts parents first. Kept nodes stay in EAGLE's code order: layer by layer,
within a layer by the parent's frontier rank (descending P), then by the child's rank.

Children are chosen deterministically (top-k), so these trees are greedy-only: at T > 0 the
dynamic-tree driver refuses them with a DraftforgeError (decode/dynamic.py), rather than verify
them with a rule that would not be lossless.

Legend: B frontier nodes at one depth, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftforge.decode.checks import check_context, check_dynamic_drafter, draft_vocab_size, positive_int
from draftforge.decode.control import BuilderController
from draftforge.decode.engine import SpeculativeDecoder
from draftforge.decode.methods import Method, MethodOptions, option, register_method
from draftforge.decode.plan import DynamicTree, TreeBuilder
from draftforge.errors import RecipeError

# EAGLE's eval-script defaults (SafeAILab/EAGLE @bfeb532: --top-k 10 --depth 5 --total-token 60)
DEFAULT_TOP_K, DEFAULT_DEPTH, DEFAULT_TOTAL_TOKENS = 10, 5, 60


def by_joint(candidates: list[tuple[int, float]], k: int | None = None) -> list[tuple[int, float]]:
    """(node, P) sorted by P descending, ties by creation order (parents before children); the first k."""
    ranked = sorted(candidates, key=lambda c: (-c[1], c[0]))
    return ranked if k is None else ranked[:k]


class Eagle2Builder(TreeBuilder):
    """EAGLE-2 expand (+ rerank unless `rerank=False`, which keeps the whole pool T1 for harvesting)."""

    def __init__(self, top_k: int = DEFAULT_TOP_K, depth: int = DEFAULT_DEPTH,
                 total_tokens: int = DEFAULT_TOTAL_TOKENS, rerank: bool = True):
        self.top_k, self.depth, self.total_tokens, self.rerank = top_k, depth, total_tokens, rerank

    @property
    def layers(self) -> int:
        """Draft layers (the paper's dmax)."""
        return self.depth + 1

    def pool_size(self) -> int:
        return self.top_k + self.depth * self.top_k ** 2

    def expand(self, depth: int, logits_BV: torch.Tensor, joint_B: torch.Tensor) -> list[list[int]]:
        return logits_BV.topk(self.top_k, dim=-1).indices.tolist()

    def frontier(self, depth: int, candidates: list[tuple[int, float]]) -> list[int]:
        """The global top-k new nodes by P, best first (EAGLE's `topk(cu_scores.view(-1), K)` order)."""
        return [node for node, _ in by_joint(candidates, self.top_k)]

    def finish(self, parents: list[int], joint: list[float]) -> list[int]:
        if not self.rerank:
            return list(range(len(parents)))
        kept = by_joint(list(enumerate(joint)), self.total_tokens - 1)
        return sorted(node for node, _ in kept)  # pool order = EAGLE's ascending index order

    def plan(self) -> DynamicTree:
        return DynamicTree(self, self.layers)


def check_eagle2(top_k: int, depth: int, total_tokens: int, target, drafter, top_k_flag: str = "--eagle-top-k") -> None:
    """Refuse settings this target/drafter cannot run: k beyond the (draft) vocabulary, a budget beyond the context.
    `top_k_flag`: the flag that set k, named in the error (`harvest trees` calls it --top-k)."""
    check_dynamic_drafter(drafter, "eagle2")
    vocab = draft_vocab_size(drafter, target)
    if top_k > vocab:
        raise RecipeError(f"{top_k_flag} {top_k} is larger than the drafter's vocabulary ({vocab} tokens); "
                          f"use at most {vocab}")
    if total_tokens < 2:
        raise RecipeError(f"--total-tokens must be >= 2 (the root plus at least one draft), got {total_tokens}")
    check_context(total_tokens, target, "--total-tokens")


@dataclass(frozen=True)
class Eagle2Options(MethodOptions):
    eagle_top_k: int = option(DEFAULT_TOP_K, "EAGLE-2: children per frontier node and frontier width k "
                              f"(default {DEFAULT_TOP_K})", check=positive_int)
    eagle_depth: int = option(DEFAULT_DEPTH, "EAGLE-2: expansion rounds after the first layer, EAGLE's `depth` "
                              f"(draft layers = depth + 1; default {DEFAULT_DEPTH})", check=positive_int)
    total_tokens: int = option(DEFAULT_TOTAL_TOKENS, "EAGLE-2 rerank budget N: tokens per verification, root "
                               f"included (EAGLE's total_token; default {DEFAULT_TOTAL_TOKENS})", check=positive_int)


def make_eagle2(target, drafter, o: Eagle2Options):
    check_eagle2(o.eagle_top_k, o.eagle_depth, o.total_tokens, target, drafter)
    builder = Eagle2Builder(o.eagle_top_k, o.eagle_depth, o.total_tokens)
    return SpeculativeDecoder("eagle2", target, drafter, BuilderController(builder.plan()))


# ---------------------------------------------------------------- the method

register_method(Method("eagle2", "EAGLE-2 dynamic tree: top-k expand + rerank to --total-tokens (greedy only)",
                       True, make_eagle2, Eagle2Options, dynamic_trees=True))
