"""Drafters that read the target: the EAGLE-3 head (models/eagle3.py) and the feature-conditioned Mamba2 drafter
(models/feature_mamba.py), both fed the target's own states of the committed tokens.

State: the head's keys and values of every committed anchor (step 0: the target's feature of position t with the
token x_{t+1}), fed from the target's `take_features()` at the start of each draft. A draft runs the head from
the last anchor (the root) and then over tree nodes: a node consumes its token and its parent's output state, at
position len(seq) - 1 + depth, and attends to every anchor, its ancestors and itself. The tree's keys are thrown
away after the verification: the accepted tokens come back next round with the target's features for them
(as EAGLE does), so nothing is ever rolled back inside the head. The Mamba2 body keeps one recurrent state for the
anchors instead of keys and values, and a state per tree node continued from its parent's.

Static trees and chains are drafted through the same node interface (`begin` / `feed`) that EAGLE-2 and C2T drive.

A window (`Eagle3Drafter(window=W)`, `--head-window`) keeps only the last W anchors' keys and values: the head is one
layer, so an anchor's key and value depend on its own token and feature alone, and dropping the oldest rows is all a
sliding window takes. The root then attends to exactly the last W anchors, a tree node to those and its ancestors; a
long prompt is encoded as its last W anchors only, and the cache holds W rows at any context.
Legend: Q new nodes, K keys, D hidden size, N draft vocabulary, A aux width.
"""

from __future__ import annotations

import torch

from draftforge.argcheck import check_token_count
from draftforge.decode.memory import tensor_bytes
from draftforge.decode.drafters.base import Drafter, chain_stops, propose_level, stack_q
from draftforge.decode.drafters.ssm_state import prompt_chunk
from draftforge.decode.plan import as_plan
from draftforge.decode.sampling import SamplingParams
from draftforge.decode.tree import DraftTree
from draftforge.decode.tree_shape import TreeShape
from draftforge.errors import DraftforgeError


class FeatureDrafter(Drafter):
    """What both feature-reading drafters share: anchors fed from the target's committed states, the root's and
    every node's output state, trees through the node interface. A body implements `_feed_anchors` (extend the
    committed state) and `_feed_nodes` (run tree nodes from their parents' states), and `_clear_tree`."""

    follows_dynamic_trees = True
    reads_target_hidden = True
    body = "abstract"

    def __init__(self, head, vocab_size: int, tokenizer=None):
        self.model, self.tokenizer, self.vocab_size = head, tokenizer, vocab_size
        d2t = head.draft_to_target()
        self.d2t = None if d2t is None else d2t.to(head.device)
        self.reset()

    def bind(self, target) -> None:
        """Serve `target`: checked against the head's shape, its embedding read, its feature layers asked for."""
        self.model.config.check_target(target.model.config, "(loaded)")
        self.model.use_embedding(target.model.get_input_embeddings())
        target.want_features(self.model.config.aux_layers)
        self.target = target

    def reset(self) -> None:
        self.anchors = 0
        self.root_out = self.root_logits = None
        self._reset_body()
        self._clear_tree()

    def _clear_tree(self) -> None:
        self.node_parent: dict[int, int] = {}
        self.node_depth: dict[int, int] = {-1: 0}
        self.node_out: dict[int, torch.Tensor] = {}
        self.node_map = None

    def _reset_body(self) -> None:
        raise NotImplementedError

    def _anchor_rows(self, m: int) -> int:
        """How many of m newly committed anchors the body must be fed (the last ones): all of them, unless a window
        drops the others anyway."""
        return m

    def _feed_anchors(self, tokens, features, positions) -> torch.Tensor:
        raise NotImplementedError

    def _feed_nodes(self, parents: list[int], tokens, feature_QD, positions, nodes: list[int]) -> torch.Tensor:
        raise NotImplementedError

    # ---- the committed prefix

    @torch.inference_mode()
    def _sync(self, seq: list[int]) -> bool:
        """Feed the anchors the target has committed since the last draft; False when there is none yet (a
        one-token prompt: the target has encoded nothing)."""
        self._clear_tree()
        features = self.target.take_features() if self.target is not None else None
        if features is not None:
            m, head = len(features), self.model
            if self.anchors + m != len(seq) - 1:
                raise DraftforgeError(f"the {self.kind} drafter holds {self.anchors} anchors and got {m} new target "
                                      f"states for a sequence of {len(seq)} tokens (it needs {len(seq) - 1}): "
                                      "draft with the target it is bound to, round by round")
            device, n = head.device, self._anchor_rows(m)  # the last n new anchors are all the body reads
            tokens = torch.tensor(seq[len(seq) - n :], device=device)
            positions = torch.arange(len(seq) - n, len(seq), device=device)
            out_QD = self._feed_anchors(tokens, head.fuse(features[m - n :].to(device)), positions)
            self.anchors += m
            self.root_out = out_QD[-1]
            self.root_logits = head.logits(self.root_out)[None].float()
        self.committed = len(seq)
        self.node_out[-1] = self.root_out
        return self.anchors > 0 and self.anchors == len(seq) - 1

    def draft(self, seq: list[int], plan, params: SamplingParams, generator) -> DraftTree:
        if not self._sync(seq):  # nothing of the target's yet: this round decodes one token
            self._synced = False
            return DraftTree([], [], [])
        self._synced = True
        return super().draft(seq, as_plan(plan), params, generator)

    # ---- the node interface (dynamic trees; static ones below use it too)

    def begin(self, seq: list[int]) -> torch.Tensor:
        if not getattr(self, "_synced", False) and not self._sync(seq):
            raise DraftforgeError(f"the {self.kind} drafter has no target state to draft from (a one-token prompt)")
        self._synced = False
        return self.root_logits

    @torch.inference_mode()
    def feed(self, parents: list[int], tokens: list[int], nodes: list[int]) -> torch.Tensor:
        """New nodes in one forward: each reads its parent's output (and state) at position len(seq) - 1 + depth."""
        head = self.model
        device = head.device
        for node, parent in zip(nodes, parents):
            self.node_parent[node] = parent
            self.node_depth[node] = self.node_depth[parent] + 1
        positions = torch.tensor([self.committed - 1 + self.node_depth[n] for n in nodes], device=device)
        feature_QD = torch.stack([self.node_out[p] for p in parents])
        out_QD = self._feed_nodes(parents, torch.tensor(tokens, device=device), feature_QD, positions, nodes)
        for q, node in enumerate(nodes):
            self.node_out[node] = out_QD[q]
        return head.logits(out_QD).float()

    def accept_nodes(self, nodes: list[int]) -> None:
        self._clear_tree()  # the accepted tokens return with the target's own states next round

    # ---- static trees and chains

    def draft_levels(self, seq, shape: TreeShape, params: SamplingParams, generator, stop=None) -> DraftTree:
        logits_BV = self.begin(seq)
        levels, q_rows = [], []
        fed_prev = [-1]  # nodes whose logits are the rows of logits_BV
        for depth in range(1, shape.depth + 1):
            children_BW, q_BV, level = propose_level(shape, depth, logits_BV, params, self.vocab_size, generator,
                                                     self.d2t)
            levels.append(level)
            q_rows.append(q_BV)
            hidden_D = self.model.norm(self.node_out[fed_prev[0]]).float() if stop is not None else None
            if depth == shape.depth or chain_stops(stop, depth, children_BW, logits_BV, q_BV, hidden_D,
                                                   self.vocab_size, self.d2t):
                break
            fed = shape.feed_list(depth)
            new = range(len(levels[-1])) if fed is None else fed
            offset = shape.offset(depth)
            nodes = [offset + k for k in new]
            logits_BV = self.feed([shape.parents[n] for n in nodes], [levels[-1][k] for k in new], nodes)
            fed_prev = nodes
        tokens, parents, depths = shape.flatten(levels)
        q_probs = None if params.greedy else stack_q(q_rows, len(tokens), shape)
        return DraftTree(tokens, parents, depths, q_probs, is_chain=shape.is_chain)

    def accept_levels(self, path: list[int]) -> None:
        self._clear_tree()

    def teacher_forced(self, ids_1S):
        raise DraftforgeError(f"the {self.kind} drafter reads the target's states, so it has no teacher-forced pass "
                              "of its own; the θ harvest (Cali-TS) supports drafters that read only tokens")


class Eagle3Drafter(FeatureDrafter):
    """The attention head: anchors' keys/values kept; a node attends to every anchor, its ancestors and itself."""

    kind = "eagle3"
    body = "attention"

    def __init__(self, head, vocab_size: int, tokenizer=None, window: int | None = None):
        self.window = check_token_count(window, "the EAGLE-3 head's window", "every committed token",
                                        DraftforgeError)
        super().__init__(head, vocab_size, tokenizer)

    @property
    def held(self) -> int:
        """Anchors whose keys and values the cache holds: all of them, or the last `window`."""
        return self.anchors if self.window is None else min(self.anchors, self.window)

    def _reset_body(self) -> None:
        self.cache = self.model.new_cache()  # the anchors' step-0 keys/values, then the fed tree nodes'

    def _clear_tree(self) -> None:
        super()._clear_tree()
        self.node_col: dict[int, int] = {}  # fed node -> its row after the anchors
        if hasattr(self, "cache"):
            self.cache.truncate(self.held)

    def _anchor_rows(self, m: int) -> int:
        return m if self.window is None else min(m, self.window)  # a long prompt: its last `window` anchors

    def _feed_anchors(self, tokens, features, positions):
        if self.window is not None:  # the last `window` anchors after this feed: drop the oldest rows first
            keep, length = self.window - len(tokens), self.cache.length  # keep >= 0: _anchor_rows cut the feed
            if length > keep:
                self.cache.keep_rows(0, torch.arange(length - keep, length, device=self.cache.k.device))
        return self.model.step(tokens, features, positions, self.cache, None)

    def _feed_nodes(self, parents, tokens, feature_QD, positions, nodes):
        n_past, n_tree = self.held, len(self.node_col)
        cols = torch.zeros(len(nodes), n_past + n_tree + len(nodes), dtype=torch.bool)
        cols[:, :n_past] = True
        for q, parent in enumerate(parents):
            p = parent
            while p != -1:
                cols[q, n_past + self.node_col[p]] = True
                p = self.node_parent[p]
            cols[q, n_past + n_tree + q] = True
        out_QD = self.model.step(tokens, feature_QD, positions, self.cache, cols.to(self.model.device))
        for q, node in enumerate(nodes):
            self.node_col[node] = n_tree + q
        return out_QD

    def cache_bytes(self) -> int:
        """Bytes of the anchors' keys and values: they grow with the context (up to the window's rows)."""
        return self.cache.nbytes()

    @property
    def steps_per_draft(self) -> str:
        seen = "every committed token" if self.window is None else f"the last {self.window} committed tokens"
        return ("one head step per depth (one decoder layer), after one step over the newly committed tokens; "
                f"the head attends to {seen}")


class FeatureMambaDrafter(FeatureDrafter):
    """The Mamba2 body: one recurrent state for the committed anchors; a node continues from its parent's state
    (a copy per node, never rolled back: the tree's states are dropped after the verification)."""

    kind = "feature_mamba2"
    body = "mamba2"

    def __init__(self, head, vocab_size: int, tokenizer=None):
        self.prompt_chunk = prompt_chunk(head.device)  # anchors per parallel scan of a prompt (None: one scan)
        super().__init__(head, vocab_size, tokenizer)

    def _reset_body(self) -> None:
        self.states = self.model.empty_state(1)

    def _clear_tree(self) -> None:
        super()._clear_tree()
        self.node_state: dict[int, list] = {}

    def _feed_anchors(self, tokens, features, positions):
        if self.anchors == 0:  # a prompt: parallel scans (in pieces, as the token Mamba drafters encode one)
            step, outs, states = self.prompt_chunk or len(tokens), [], None
            for start in range(0, len(tokens), step):
                out_QD, states = self.model.prefill(tokens[start : start + step], features[start : start + step],
                                                    states)
                outs.append(out_QD)
            self.states = states
            return torch.cat(outs)
        out_1QD, self.states, _ = self.model.run(tokens[None], features[None], self.states)
        return out_1QD[0]

    def _feed_nodes(self, parents, tokens, feature_QD, positions, nodes):
        per_parent = [self.states if p == -1 else self.node_state[p] for p in parents]
        states = [(torch.cat([s[j][0] for s in per_parent]), torch.cat([s[j][1] for s in per_parent]))
                  for j in range(len(self.states))]
        out_QD, new = self.model.step(tokens, feature_QD, states)
        for q, node in enumerate(nodes):
            self.node_state[node] = [(c[q : q + 1], s[q : q + 1]) for c, s in new]
        return out_QD

    def cache_bytes(self) -> int:
        """Bytes of the committed recurrent state: the same at any context."""
        return tensor_bytes(self.states)

    @property
    def steps_per_draft(self) -> str:
        return "one Mamba2 step per depth, after one step per newly committed token"
