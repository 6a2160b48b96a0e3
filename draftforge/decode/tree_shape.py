"""Static tree shapes: `TreeShape`, parent lists per layer, the one representation of a static tree past the
CLI and the Python API's entry points (`as_shape` turns a widths tuple, N_i children per node at depth i,
into its TreeShape; `parse_tree` reads the text forms).

Widths cannot draw trees whose nodes at one depth have different numbers of children, such as
STree's 13-token config A (Fig. 4a). A `TreeShape` lists, layer by layer (layer i = the nodes at
depth i+1), the index of each node's parent among the previous layer's nodes; the root layer is
implicit, so layer 0 lists 0s. A node that is its parent's r-th child (in list order) takes the
parent's r-th ranked draft token (greedy: r-th most likely; T>0: the r-th draw, distinct or i.i.d. as
SamplingParams.tree_draws says).

Text forms (`parse_tree`): `3,1,1,1` (widths), `parents:0,0,0/0,0,1/0,0,1/0,0,0`
(parent lists) and the presets in TREE_PRESETS (`stree13`).

Drafting a shape by batch expansion: at depth d only the nodes with children ("fed" nodes) are fed
to the drafter, as one batch; its rows give `branch[d]` ranked tokens each, and `take(d+1)` picks
every depth-(d+1) node's token out of that [fed rows, branch] block.
Legend: B fed nodes at one depth, W branch (tokens proposed per fed node).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from functools import cached_property, lru_cache

import torch

from draftforge.decode.tree import config_name, level_sizes, validate_widths
from draftforge.errors import DraftforgeError, RecipeError

PARENTS_PREFIX = "parents:"

# name -> parent lists per layer
TREE_PRESETS = {
    # STree config A (Fig. 4a): depth 4, width 3, 13 tokens with the root; L1 = [r, r, r],
    # L2 = [L1₀, L1₀, L1₁], L3 = [L2₀, L2₀, L2₁], L4 = [L3₀, L3₀, L3₀]
    "stree13": ((0, 0, 0), (0, 0, 1), (0, 0, 1), (0, 0, 0)),
}

OTHER_FORMS = ("parent lists per layer like parents:0,0,0/0,0,1/0,0,1/0,0,0 (each layer gives every node's parent "
               f"index among the previous layer's nodes), or a preset: {', '.join(TREE_PRESETS)}")
TREE_FORMS = f"comma-separated widths like 3,2,2,1, {OTHER_FORMS}"


def check_layers(layers) -> tuple[tuple[int, ...], ...]:
    """Parent lists per layer: non-empty layers, each parent an index into the previous layer, in order."""
    try:
        layers = tuple(tuple(layer) for layer in layers)
    except TypeError:
        raise DraftforgeError(f"tree parent lists must be a list of lists of ints, got {layers!r}") from None
    if not layers:
        raise DraftforgeError("tree parent lists are empty; give at least one layer, e.g. parents:0,0,0")
    prev = 1  # the root
    for i, layer in enumerate(layers, start=1):
        if not layer:
            raise DraftforgeError(f"tree layer {i} is empty; every layer needs at least one node "
                                  "(end the tree at the last non-empty layer)")
        for k, p in enumerate(layer):
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < prev:
                where = "the root (0)" if i == 1 else f"layer {i - 1}'s {prev} nodes (0..{prev - 1})"
                raise DraftforgeError(f"tree layer {i}, node {k}: parent index {p!r} is out of range; "
                                      f"it must index {where}")
            if k and p < layer[k - 1]:
                raise DraftforgeError(f"tree layer {i} lists parent {p} after {layer[k - 1]}: list each "
                                      "parent's children together, parents in increasing order")
        prev = len(layer)
    return layers


@dataclass(frozen=True)
class TreeShape:
    """A static draft tree as parent lists per layer (see the module docstring)."""

    layers: tuple[tuple[int, ...], ...]
    label: str | None = field(default=None, compare=False)  # a preset's name

    def __post_init__(self):
        object.__setattr__(self, "layers", check_layers(self.layers))

    @classmethod
    def from_widths(cls, widths) -> TreeShape:
        return _from_widths(validate_widths(widths))

    @property
    def depth(self) -> int:
        return len(self.layers)

    @property
    def size(self) -> int:
        """Draft tokens (the root not counted)."""
        return sum(len(layer) for layer in self.layers)

    @property
    def is_chain(self) -> bool:
        return all(len(layer) == 1 for layer in self.layers)

    def nodes_at(self, depth: int) -> int:
        return 1 if depth == 0 else len(self.layers[depth - 1])

    @cached_property
    def children(self) -> tuple[tuple[int, ...], ...]:
        """children[d][p]: children of node p at depth d (d = 0: the root) in the next layer."""
        counts = [Counter(layer) for layer in self.layers]
        return tuple(tuple(c[p] for p in range(self.nodes_at(d))) for d, c in enumerate(counts))

    @cached_property
    def widths(self) -> tuple[int, ...] | None:
        """(N1..Nγ) when every node at each depth has the same number of children, else None."""
        if any(len(set(counts)) != 1 for counts in self.children):
            return None
        return tuple(counts[0] for counts in self.children)

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        return config_name(self.widths) if self.widths is not None else self.text

    @property
    def text(self) -> str:
        """The parent-list form parse_tree reads back."""
        return PARENTS_PREFIX + "/".join(",".join(map(str, layer)) for layer in self.layers)

    def capped(self, depth: int) -> TreeShape:
        if depth >= self.depth:
            return self
        return _from_widths(self.widths[:depth]) if self.widths is not None else TreeShape(self.layers[:depth])

    @cached_property
    def branch(self) -> tuple[int, ...]:
        """branch[d]: ranked tokens to propose per fed node at depth d (its most children), d = 0..γ-1."""
        return tuple(max(counts) for counts in self.children)

    @cached_property
    def fed(self) -> tuple[tuple[int, ...], ...]:
        """fed[d]: the nodes at depth d with children (d = 0..γ-1), the rows drafted from at depth d."""
        return tuple(tuple(p for p, n in enumerate(counts) if n) for counts in self.children)

    @cached_property
    def _fed_row(self) -> tuple[dict[int, int], ...]:
        return tuple({p: row for row, p in enumerate(nodes)} for nodes in self.fed)

    @cached_property
    def parents(self) -> list[int]:
        """Breadth-first parent array of the whole tree (-1 = the root), as DraftTree holds it."""
        out, offset_prev = [], 0
        for d, layer in enumerate(self.layers):
            out += [-1 if d == 0 else offset_prev + p for p in layer]
            offset_prev = len(out) - len(layer)
        return out

    def offset(self, depth: int) -> int:
        """Breadth-first index of the first node at `depth` (>= 1)."""
        return sum(len(layer) for layer in self.layers[: depth - 1])

    def take_list(self, depth: int) -> list[int] | None:
        """Flat indices into the [len(fed[depth-1]), branch[depth-1]] token block, one per node at `depth`
        (None: the block already is the layer, as for widths trees). Built once per shape and depth."""
        key = ("take_list", depth)
        if key not in self._cache:
            self._cache[key] = self._take_list(depth)
        return self._cache[key]

    def _take_list(self, depth: int) -> list[int] | None:
        layer, rows, width = self.layers[depth - 1], self._fed_row[depth - 1], self.branch[depth - 1]
        take, rank = [], 0
        for k, p in enumerate(layer):
            rank = rank + 1 if k and p == layer[k - 1] else 0
            take.append(rows[p] * width + rank)
        return None if take == list(range(len(rows) * width)) else take

    def feed_list(self, depth: int) -> list[int] | None:
        """Indices into the layer at `depth` of its fed nodes (None: all of them)."""
        nodes = self.fed[depth] if depth < self.depth else ()
        return None if len(nodes) == len(self.layers[depth - 1]) else list(nodes)

    def parent_rows(self, depth: int) -> list[int]:
        """For each fed node at `depth` (>= 1), its parent's row among the fed nodes at depth - 1."""
        layer, rows = self.layers[depth - 1], self._fed_row[depth - 1]
        return [rows[layer[k]] for k in self.fed[depth]]

    def fed_row(self, node: int, depth: int) -> int:
        """Row of breadth-first `node` (at `depth`, with children) among the fed nodes at that depth."""
        return self._fed_row[depth][node - self.offset(depth)]

    def fed_prefix(self, path: list[int]) -> int:
        """How many leading nodes of an accepted root path were fed (those with children)."""
        n = 0
        for d, node in enumerate(path, start=1):
            if d >= self.depth or self.children[d][node - self.offset(d)] == 0:
                break
            n += 1
        return n

    def flatten(self, level_tokens: list[list[int]]) -> tuple[list[int], list[int], list[int]]:
        """Per-depth token lists (the first len(level_tokens) layers) -> breadth-first tokens/parents/depths."""
        tokens = [int(t) for toks in level_tokens for t in toks]
        depths = [d for d, toks in enumerate(level_tokens, start=1) for _ in toks]
        return tokens, self.parents[: len(tokens)], depths

    @cached_property
    def _cache(self) -> dict:
        return {}

    def index(self, kind: str, depth: int, device) -> torch.Tensor | None:
        """`take_list` / `feed_list` as a LongTensor on `device`, built once per shape and device."""
        key = (kind, depth, str(device))
        if key not in self._cache:
            idx = (self.take_list if kind == "take" else self.feed_list)(depth)
            self._cache[key] = None if idx is None else torch.tensor(idx, device=device)
        return self._cache[key]


@lru_cache(maxsize=64)
def _from_widths(widths: tuple[int, ...]) -> TreeShape:
    sizes = [1] + level_sizes(widths)
    return TreeShape(tuple(tuple(p for p in range(sizes[i]) for _ in range(w)) for i, w in enumerate(widths)))


def as_shape(tree) -> TreeShape:
    """The one way in: a TreeShape as is, widths (N1..Nγ) as their TreeShape (checked, cached per widths)."""
    return tree if isinstance(tree, TreeShape) else TreeShape.from_widths(tuple(tree))


def parse_tree(text, flag: str = "--tree") -> TreeShape:
    """The one reader of a tree's text: '3,2,2,1' (widths), 'parents:0,0,0/0,0,1' or a preset name ('stree13') ->
    its TreeShape, checked. A RecipeError naming `flag` says what is wrong."""
    text = str(text).strip()
    if text in TREE_PRESETS:
        return TreeShape(TREE_PRESETS[text], label=text)
    if text.startswith(PARENTS_PREFIX):
        try:
            body = text[len(PARENTS_PREFIX):]
            return TreeShape(tuple(tuple(int(p) for p in layer.split(",") if p.strip()) for layer in body.split("/")))
        except ValueError:
            raise RecipeError(f"{flag} {text!r}: cannot read the tree {text!r}; give {TREE_FORMS}") from None
        except DraftforgeError as e:
            raise RecipeError(f"{flag} {text!r}: {e}") from None
    try:
        widths = tuple(int(p) for p in text.split(",") if p.strip())
    except ValueError:
        raise RecipeError(f"{flag} expects comma-separated integers like 3,2,2,1, got {text!r} (or give "
                          f"{OTHER_FORMS})") from None
    return widths_shape(widths, flag)


def widths_shape(widths, where: str = "tree") -> TreeShape:
    """Widths (N1..Nγ) -> their TreeShape, or a RecipeError naming `where` when a width is not >= 1."""
    try:
        return as_shape(tuple(widths))
    except (DraftforgeError, TypeError):
        raise RecipeError(f"{where} {tuple(widths)}: every tree width must be >= 1, i.e. a positive integer "
                          "(a tree needs every width >= 1, e.g. 3,2,2,1)") from None
