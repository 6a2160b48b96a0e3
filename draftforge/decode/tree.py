"""Draft trees: layout, validation, and the packed tree attention mask used in one verify forward.

Layout: nodes are stored breadth-first; a configuration (N1, ..., Nγ) gives every node at depth
i-1 exactly N_i children, so depth i holds B_i = N1·…·N_i nodes (Mamba Drafters §4.1). A chain of
length K is the configuration (1,)*K. `parents[j] == -1` means node j hangs off the root (the last
committed token).

Legend: N tree nodes, Q query tokens, K key tokens, V vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from draftforge.errors import DraftforgeError
from draftforge.kernels.tree_pack import ancestor_mask


def validate_widths(widths) -> tuple[int, ...]:
    """Check a tree configuration (N1, ..., Nγ): non-empty, every width a positive int."""
    widths = tuple(widths)
    if not widths:
        raise DraftforgeError("tree configuration is empty; give at least one width, e.g. (3, 2, 2, 1)")
    for w in widths:
        if isinstance(w, bool) or not isinstance(w, int) or w <= 0:
            raise DraftforgeError(f"tree configuration {widths}: every width must be a positive integer, got {w!r}")
    return widths


def level_sizes(widths: tuple[int, ...]) -> list[int]:
    """B_i = N1·…·N_i for i = 1..γ."""
    sizes, b = [], 1
    for w in widths:
        b *= w
        sizes.append(b)
    return sizes


def config_name(widths: tuple[int, ...]) -> str:
    return "x".join(str(w) for w in widths)


@dataclass
class DraftTree:
    """What a drafter proposes: tokens, parents, depths (1-based) and, at T>0, the drafter
    distribution each node's children were sampled from (row 0 = root, row 1+j = node j)."""

    tokens: list[int]
    parents: list[int]
    depths: list[int]
    q_probs: torch.Tensor | None = None  # [1+N, V]; rows of leaves are unused
    is_chain: bool = False
    # Every node is a fixed proposal, not a draw (prompt lookup): its q is the point mass on itself, so at T>0
    # siblings are tried one by one against p with each rejected token removed (verify.py)
    fixed_drafts: bool = False

    def __post_init__(self) -> None:
        # every target verifies a tree in this order (a parent's row before its child's); a drafter that breaks it
        # is told here, in the drafter's own node numbers, not by whichever target's packing meets it first
        if not len(self.tokens) == len(self.parents) == len(self.depths):
            raise DraftforgeError(f"a draft tree needs one parent and one depth per token: {len(self.tokens)} tokens, "
                                  f"{len(self.parents)} parents, {len(self.depths)} depths")
        for j, p in enumerate(self.parents):
            if not -1 <= p < j:
                raise DraftforgeError(f"draft tree node {j} has parent {p}: a node's parent must come before it "
                                      "(-1 for the root's children)")

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        """Children of `node` (-1 = root) in sampling order."""
        return [j for j, p in enumerate(self.parents) if p == node]

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)


def ancestor_matrix(parents: list[int]) -> torch.Tensor:
    """anc_NN[i, j] = True when node j is node i or one of its ancestors (the tree scan's mask, one tree)."""
    return ancestor_mask(torch.tensor([parents]))[0]


def packed_tree_mask(anc_QK: torch.Tensor, past_len: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Additive 4D mask [1, 1, Q, past_len + K]: every query sees the whole committed prefix and,
    inside the packed tree, only its own root path. Additive floats work for eager and SDPA alike."""
    q, k = anc_QK.shape
    allowed_QK = torch.cat([torch.ones(q, past_len, dtype=torch.bool), anc_QK], dim=1)
    mask_QK = torch.zeros(q, past_len + k, dtype=dtype)
    mask_QK.masked_fill_(~allowed_QK, torch.finfo(dtype).min)
    return mask_QK.to(device)[None, None]


def root_path(parents: list[int], node: int) -> list[int]:
    """Node indices from depth 1 down to `node` (inclusive)."""
    path = []
    while node >= 0:
        path.append(node)
        node = parents[node]
    return path[::-1]
