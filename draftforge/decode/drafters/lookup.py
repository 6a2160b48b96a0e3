"""Prompt lookup (n-gram) drafting: copy what followed an earlier occurrence of the text's last n tokens.

The free baseline (LLMA, arXiv:2304.04487; transformers' `prompt_lookup_num_tokens`, vLLM's `ngram`,
llama.cpp's lookup decoding): no model, only token ids, so it serves every target kind. The suffix
n-gram is tried for n = max_ngram down to min_ngram; a match's continuation is the tokens after it,
repeated with the match's period where it runs into the end of the text (a loop keeps looping).

Trees: the matches (longest n first, most recent first) are merged into a trie laid on the plan's
shape; a node's r-th distinct next token takes the shape's r-th child slot, so depth-1 siblings are
distinct continuations and each goes on along its own match. Slots no match reaches stay empty: the
tree is a subtree of the plan (possibly empty, then the round is plain decoding). At T>0 every
node is a fixed proposal (q one-hot), verified exactly by verify.py's fixed-drafts rule.

Legend: N draft nodes, V vocabulary.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from draftforge.decode.drafters.base import Drafter
from draftforge.decode.plan import DraftStep, DynamicTree, as_plan
from draftforge.decode.sampling import SamplingParams
from draftforge.decode.tree import DraftTree
from draftforge.decode.tree_shape import TreeShape
from draftforge.errors import DraftforgeError

DEFAULT_MAX_NGRAM = 3
DEFAULT_MAX_MATCHES = 64  # matches merged into one tree at most: bounds the work on long, repetitive texts


class NgramIndex:
    """Every n-gram (min_ngram <= n <= max_ngram) of a token list -> the positions right after its occurrences,
    kept up to date as the list grows, so a lookup costs O(matches), not a scan of the text."""

    def __init__(self, max_ngram: int, min_ngram: int = 1):
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.reset()

    def reset(self) -> None:
        self.tokens: list[int] = []
        self.after = {n: {} for n in range(self.min_ngram, self.max_ngram + 1)}

    def sync(self, seq: list[int]) -> None:
        """Index `seq`: only its new tokens when it extends what was indexed, else from scratch."""
        n_old = len(self.tokens)
        if len(seq) < n_old or seq[:n_old] != self.tokens:  # another text (the caller skipped reset)
            self.reset()
            n_old = 0
        for p in range(max(n_old, 1), len(seq)):  # token p now exists: the n-grams ending before it have a successor
            for n, table in self.after.items():
                if p >= n:
                    table.setdefault(tuple(seq[p - n : p]), []).append(p)
        self.tokens.extend(seq[n_old:])  # a copy: the engine grows `seq` in place

    def matches(self):
        """(n, p) for earlier occurrences of the text's suffix n-gram, longest n first, most recent first;
        p is where the occurrence's continuation starts (always < len: the suffix itself is not indexed)."""
        seq = self.tokens
        for n in range(min(self.max_ngram, len(seq)), self.min_ngram - 1, -1):
            for p in reversed(self.after[n].get(tuple(seq[len(seq) - n :]), ())):
                yield n, p

    def continuation(self, p: int, length: int) -> list[int]:
        """`length` tokens from position p; past the end, the text is extended by its own period len - p."""
        seq, out = self.tokens, []
        for t in range(length):
            out.append(seq[p + t] if p + t < len(seq) else out[p + t - len(seq)])
        return out


@lru_cache(maxsize=64)
def child_slots(shape: TreeShape) -> tuple[dict[int, list[int]], ...]:
    """slots[d][parent] = the indices, in layer d (nodes at depth d+1), of that parent's children, in rank order."""
    slots = []
    for layer in shape.layers:
        by_parent: dict[int, list[int]] = {}
        for k, parent in enumerate(layer):
            by_parent.setdefault(parent, []).append(k)
        slots.append(by_parent)
    return tuple(slots)


def trie_tree(continuations, shape: TreeShape, depth: int, max_matches: int) -> tuple[list[int], list[int], list[int]]:
    """Merge continuations (best first) into the shape's slots down to `depth`; breadth-first tokens, parents,
    depths of the slots filled. A continuation stops where its next token finds no free slot."""
    slots, size = child_slots(shape), sum(len(layer) for layer in shape.layers[:depth])
    token_at = [{} for _ in range(depth)]  # per layer: slot -> token
    child = {}  # (layer, parent slot, token) -> slot
    used = [{} for _ in range(depth)]  # per layer: parent slot -> children placed
    filled = 0
    for count, cont in enumerate(continuations):
        if count >= max_matches or filled == size:
            break
        parent = 0  # the root's slot
        for d, tok in enumerate(cont[:depth]):
            key = (d, parent, tok)
            if key not in child:
                free, placed = slots[d].get(parent, []), used[d].get(parent, 0)
                if placed == len(free):
                    break  # no free slot for another sibling here: the rest of this continuation is dropped
                child[key], used[d][parent] = free[placed], placed + 1
                token_at[d][child[key]] = tok
                filled += 1
            parent = child[key]
    return _breadth_first(token_at, shape)


def _breadth_first(token_at: list[dict[int, int]], shape: TreeShape) -> tuple[list[int], list[int], list[int]]:
    tokens, parents, depths, index_prev = [], [], [], {0: -1}
    for d, placed in enumerate(token_at):
        index = {}
        for slot in sorted(placed):
            index[slot] = len(tokens)
            tokens.append(placed[slot])
            parents.append(index_prev[shape.layers[d][slot]] if d else -1)
            depths.append(d + 1)
        index_prev = index
    return tokens, parents, depths


class PromptLookupDrafter(Drafter):
    """Drafts by n-gram lookup in the prompt + generated text (see the module docstring); no model."""

    kind = "lookup"

    def __init__(self, vocab_size: int, max_ngram: int = DEFAULT_MAX_NGRAM, min_ngram: int = 1,
                 max_tokens: int | None = None, max_matches: int = DEFAULT_MAX_MATCHES):
        if not 1 <= min_ngram <= max_ngram:
            raise DraftforgeError(f"prompt lookup needs 1 <= min_ngram <= max_ngram, got {min_ngram} and {max_ngram}")
        if max_tokens is not None and max_tokens < 1:
            raise DraftforgeError(f"prompt lookup's proposal length must be >= 1, got {max_tokens}")
        self.vocab_size, self.max_tokens, self.max_matches = vocab_size, max_tokens, max_matches
        self.index = NgramIndex(max_ngram, min_ngram)

    def bind(self, target) -> None:
        super().bind(target)
        self.tokenizer = target.tokenizer  # the target's own ids: there is nothing to check

    def reset(self) -> None:
        self.index.reset()

    def draft(self, seq: list[int], plan, params: SamplingParams, generator) -> DraftTree:
        if isinstance(as_plan(plan), DynamicTree):
            raise DraftforgeError("the prompt-lookup drafter has no next-token probabilities for a dynamic tree "
                                  "builder to rank; use it with chain, tree or ucb (static trees)")
        return super().draft(seq, plan, params, generator)

    def draft_levels(self, seq, shape: TreeShape, params: SamplingParams, generator, stop=None) -> DraftTree:
        depth = shape.depth if self.max_tokens is None else min(shape.depth, self.max_tokens)
        self.index.sync(seq)
        continuations = (self.index.continuation(p, depth) for _, p in self.index.matches())
        tokens, parents, depths = trie_tree(continuations, shape, depth, self.max_matches)
        if stop is not None and tokens:  # a chain: the stop rule sees each draft with q = 1 on it
            tokens = tokens[: self._stop_at(tokens, stop)]
            parents, depths = parents[: len(tokens)], depths[: len(tokens)]
        chain = all(p == j - 1 for j, p in enumerate(parents))
        q_probs = None if params.greedy else self._point_masses(tokens, parents)
        return DraftTree(tokens, parents, depths, q_probs, is_chain=chain, fixed_drafts=True)

    def _stop_at(self, tokens: list[int], stop) -> int:
        """How many of a chain's drafts to keep: up to and including the first the stop rule ends after."""
        for depth, tok in enumerate(tokens, start=1):
            logits_V = torch.full((self.vocab_size,), float("-inf"))
            logits_V[tok] = 0.0
            if stop.should_stop(DraftStep(depth, tok, logits_V, 1.0, None)):
                return depth
        return len(tokens)

    def _point_masses(self, tokens: list[int], parents: list[int]) -> torch.Tensor:
        """q rows [1+N, V]: row 1+j (0 = root) one-hot on node j's first child; leaves' rows stay zero. Chains
        verify with these; trees use the fixed-drafts rule, which is the same point mass for every sibling."""
        device = self.target.device if self.target is not None else "cpu"
        q_NV = torch.zeros(1 + len(tokens), self.vocab_size, device=device)
        for j in reversed(range(len(tokens))):  # reversed: the first child of a parent is written last
            q_NV[1 + parents[j]].zero_()
            q_NV[1 + parents[j], tokens[j]] = 1.0
        return q_NV

    def accept_levels(self, path: list[int]) -> None:
        """Nothing to roll back: the next draft indexes the committed tokens it is given."""

    @property
    def steps_per_draft(self) -> str:
        return "no model forward (n-gram lookup)"

    def teacher_forced(self, ids_1S):
        raise DraftforgeError("the prompt-lookup drafter has no model, so there are no drafter logits or hidden "
                              "states to harvest; harvest with a trained drafter")
