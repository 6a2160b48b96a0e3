"""Draft plans: what a controller asks the drafter for in one round.

- `StaticTree(tree)`: the same tree every round, a TreeShape (decode/tree_shape.py): parent lists per
  layer, built from widths N_i children per node at depth i when given those (Mamba Drafters §4.1; a chain
  of K drafts is `StaticTree((1,) * K)`) or given as such for trees widths cannot draw (STree's config A).
- `StoppableChain(max_len, stop)`: a chain that a `StopRule` may end after any drafted token
  (Beta-TS / Cali-TS, EESD §3.3; SpecDec++'s threshold rule).
- `DynamicTree(builder)`: a `TreeBuilder` decides depth by depth which drafted nodes get children
  and how many (EAGLE-2 expand + rerank, C2T's classifier pruning); see decode/dynamic.py.

Whatever the plan, the drafter returns a DraftTree (parents of any shape); the engine, verifiers
and metrics read depth and size from that tree.
Legend: B frontier nodes at one depth, V vocabulary, D hidden size.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from draftforge.decode.tree import validate_widths
from draftforge.decode.tree_shape import TreeShape, as_shape


@dataclass
class DraftStep:
    """What a stop rule sees after each drafted token of a chain."""

    depth: int  # 1-based depth of the token just drafted
    token: int
    logits_V: torch.Tensor  # the drafter's logits the token was chosen from
    prob: float  # the drafter's probability of the token (its q at T>0, softmax of the logits at T=0)
    # the drafter's last hidden state (final norm applied) whose logits chose `token`; given only to a
    # rule with `wants_hidden` set, so it costs nothing otherwise
    hidden_D: torch.Tensor | None = None


class StopRule:
    """Decides after every drafted token whether the chain goes on."""

    wants_hidden = False  # True: the drafter fills DraftStep.hidden_D (Cali-TS's θ predictor reads it)

    def start_round(self) -> None:
        """A new round's chain begins."""

    def should_stop(self, step: DraftStep) -> bool:
        raise NotImplementedError


class TreeBuilder:
    """Builds a tree depth by depth (decode/dynamic.py drives it).

    `expand(depth, logits_BV, joint_B)` gets the next-token logits of the B frontier nodes (the
    root alone at depth 1) and their joint probabilities, and returns, per frontier node, the
    child tokens to add; `frontier(children)` picks which of the new nodes are fed to the drafter
    (their children come next); `finish(tree)` may keep a subset of the nodes (a valid subtree)
    before verification. Builders that choose children deterministically (top-k) are greedy-only.
    """

    sampling_ok = False  # True only if children are drawn from q as propose_children draws them (then MSS is exact)

    def expand(self, depth: int, logits_BV: torch.Tensor, joint_B: torch.Tensor) -> list[list[int]]:
        raise NotImplementedError

    def frontier(self, depth: int, candidates: list[tuple[int, float]]) -> list[int]:
        """From (node index, joint probability) of the nodes just added, the ones to feed next."""
        return [node for node, _ in candidates]

    def finish(self, parents: list[int], joint: list[float]) -> list[int]:
        """Node indices to verify (default: all); must be closed under taking parents."""
        return list(range(len(parents)))


@dataclass(frozen=True)
class StaticTree:
    tree: TreeShape  # given as widths (N1..Nγ) or a TreeShape; kept as the TreeShape

    def __post_init__(self):
        object.__setattr__(self, "tree", as_shape(self.tree))

    @property
    def widths(self) -> tuple[int, ...] | None:
        """(N1..Nγ) when the shape is one; None for other shapes."""
        return self.tree.widths

    @property
    def max_depth(self) -> int:
        return self.tree.depth

    def capped(self, depth: int) -> StaticTree | None:
        return StaticTree(self.tree.capped(depth)) if depth > 0 else None

    @property
    def name(self) -> str:
        return self.tree.name


@dataclass(frozen=True)
class StoppableChain:
    max_len: int
    stop: StopRule

    def __post_init__(self):
        validate_widths((self.max_len,))

    @property
    def max_depth(self) -> int:
        return self.max_len

    def capped(self, depth: int) -> StoppableChain | None:
        return replace(self, max_len=min(self.max_len, depth)) if depth > 0 else None

    @property
    def name(self) -> str:
        return f"chain<={self.max_len}"


@dataclass(frozen=True)
class DynamicTree:
    builder: TreeBuilder
    max_len: int  # deepest level the builder may reach

    @property
    def max_depth(self) -> int:
        return self.max_len

    def capped(self, depth: int) -> DynamicTree | None:
        return replace(self, max_len=min(self.max_len, depth)) if depth > 0 else None

    @property
    def name(self) -> str:
        return f"{type(self.builder).__name__}<={self.max_len}"


def as_plan(plan_or_tree) -> StaticTree | StoppableChain | DynamicTree:
    """A plan as is; a widths tuple or TreeShape as the static tree it names."""
    if isinstance(plan_or_tree, (StaticTree, StoppableChain, DynamicTree)):
        return plan_or_tree
    return StaticTree(as_shape(plan_or_tree))
