"""Transformer drafter (the external-drafter baseline): KV cache, chain and tree drafting.

Tree drafting feeds each depth's nodes that have children as one packed forward with a tree mask over
the nodes already fed; rollback keeps the committed prefix plus the accepted nodes' K/V.

Legend: B nodes at one depth, V vocabulary.
"""

from __future__ import annotations

import warnings

import torch

from draftforge.decode.drafters.base import Drafter, chain_stops, draft_map, propose_level, stack_q, wants_hidden
from draftforge.decode.memory import cache_bytes
from draftforge.decode.sampling import SamplingParams
from draftforge.decode.targets import CachedLM, check_full_attention, max_context
from draftforge.errors import DraftforgeError
from draftforge.decode.tree import DraftTree, ancestor_matrix, packed_tree_mask
from draftforge.decode.tree_shape import TreeShape


class TransformerDrafter(Drafter):
    kind = "transformer"
    follows_dynamic_trees = True

    def __init__(self, model, vocab_size: int, tokenizer=None):
        check_full_attention(model.config, "drafter")
        self.model, self.tokenizer, self.vocab_size = model, tokenizer, vocab_size
        self.d2t = draft_map(model, vocab_size)
        self.lm = CachedLM(model)
        self.max_context = max_context(model.config)
        # rotary positions are computed for any index (acceptance falls past training length); learned ones are a
        # table that ends at max_context: the forward past it fails with an IndexError deep in torch
        self.rotary = any("Rotary" in type(m).__name__ for m in model.modules())
        self._warned_context = False
        self.reset()

    def check_context(self, positions: int) -> None:
        ctx = self.max_context
        if ctx is None or positions <= ctx:
            return
        if not self.rotary:
            raise DraftforgeError(f"the drafter has learned position embeddings for {ctx} positions, and this decode "
                                  f"may reach {positions} (prompt + max_new_tokens); shorten the prompt or "
                                  "max_new_tokens, or use a drafter with a longer context")
        if not self._warned_context:
            self._warned_context = True
            warnings.warn(f"the drafter's context is {ctx} positions (its max_position_embeddings) and this decode "
                          f"may reach {positions}: it drafts past them with rotary positions it was not trained on, "
                          "so acceptance may fall (the output is the target's either way)", stacklevel=3)

    def reset(self) -> None:
        self.lm.reset()
        self.last_logits_V = self.last_hidden_D = None

    def cache_bytes(self) -> int:
        """The drafter's own KV cache: it grows with the context."""
        return cache_bytes(self.lm.cache)

    def _sync(self, seq: list[int], hidden: bool = False) -> torch.Tensor:
        """Feed committed tokens the cache has not seen; return logits after seq[-1] (with `hidden`, also
        keep the final-normed hidden state there in `last_hidden_D`)."""
        pending = seq[self.lm.length :]
        if pending:
            out = self.lm.forward(pending, last_only=True, hidden=hidden)
            logits_QV, self.last_hidden_D = (out[0], out[1][-1]) if hidden else (out, None)
            self.last_logits_V = logits_QV[-1]
        return self.last_logits_V

    def draft_levels(self, seq, shape: TreeShape, params: SamplingParams, generator, stop=None) -> DraftTree:
        hidden = wants_hidden(stop)  # chains only: a stop rule that reads the hidden state
        logits_BV = self._sync(seq, hidden)[None]
        hidden_D = self.last_hidden_D if hidden else None
        self.committed, self.slot = len(seq), {}  # slot: tree node -> its row in the cache after the prefix
        levels, q_rows = [], []
        for depth in range(1, shape.depth + 1):
            children_BW, q_BV, level = propose_level(shape, depth, logits_BV, params, self.vocab_size, generator,
                                                     self.d2t)
            levels.append(level)
            q_rows.append(q_BV)
            if depth == shape.depth or chain_stops(stop, depth, children_BW, logits_BV, q_BV, hidden_D,
                                                   self.vocab_size, self.d2t):
                break
            logits_BV = self._feed_level(shape, levels, hidden)
            if hidden:
                logits_BV, hidden_D = logits_BV[0], logits_BV[1][0]
        tokens, parents, depths = shape.flatten(levels)
        q_probs = None if params.greedy else stack_q(q_rows, len(tokens), shape)
        return DraftTree(tokens, parents, depths, q_probs, is_chain=shape.is_chain)

    def _feed_level(self, shape, levels: list[list[int]], hidden: bool = False):
        """Feed the newest depth's fed nodes (those with children) in one forward; every node sees the prefix
        and its own ancestors."""
        depth = len(levels)
        fed = shape.feed_list(depth)
        new = range(len(levels[-1])) if fed is None else fed
        offset = shape.offset(depth)
        for k in new:
            self.slot[offset + k] = len(self.slot)
        positions = [self.committed + depth - 1] * len(new)
        mask = None
        if any(len(nodes) > 1 for nodes in shape.fed[1 : depth + 1]):  # fed nodes that are not one chain
            order = list(self.slot)  # fed nodes in cache order; each one's parent was fed before it
            parents_fed = [-1 if shape.parents[n] == -1 else self.slot[shape.parents[n]] for n in order]
            anc_NN = ancestor_matrix(parents_fed)
            mask = packed_tree_mask(anc_NN[len(order) - len(new):], self.committed, self.model.dtype, self.lm.device)
        return self.lm.forward([levels[-1][k] for k in new], positions, mask, hidden=hidden)

    def accept_levels(self, path: list[int]) -> None:
        self.lm.keep(self.committed, [self.slot[j] for j in path if j in self.slot])  # unfed nodes hold no K/V

    # ---- node interface (dynamic trees): fed nodes sit in the cache after the committed prefix, in feed order

    def begin(self, seq: list[int]) -> torch.Tensor:
        logits_1V = self._sync(seq)[None]
        self.committed, self.fed, self.node_parent = len(seq), [], {}
        return logits_1V

    def feed(self, parents: list[int], tokens: list[int], nodes: list[int]) -> torch.Tensor:
        """Feed new nodes in one forward: each sees the prefix, its fed ancestors and itself."""
        for node, parent in zip(nodes, parents):
            self.node_parent[node] = parent
        order = self.fed + list(nodes)
        col = {n: i for i, n in enumerate(order)}
        anc_QK = torch.zeros(len(nodes), len(order), dtype=torch.bool)
        for q, node in enumerate(nodes):
            depth, n = 0, node
            while n != -1:
                anc_QK[q, col[n]], n, depth = True, self.node_parent[n], depth + 1
        positions = [self.committed + int(anc_QK[q].sum()) - 1 for q in range(len(nodes))]
        mask = packed_tree_mask(anc_QK, self.committed, self.model.dtype, self.lm.device)
        self.fed = order
        return self.lm.forward(list(tokens), positions, mask)

    def accept_nodes(self, nodes: list[int]) -> None:
        slot = {n: i for i, n in enumerate(self.fed)}
        self.lm.keep(self.committed, [slot[n] for n in nodes if n in slot])
