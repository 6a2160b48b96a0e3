"""EESD's early-exit drafter and the target it is paired with (EESD §3.1; Kangaroo/LayerSkip KV sharing).

Three caches (docs/methods/eesd.md §2): the target's own DynamicCache holds layers 1..N (written while drafting,
shared with the drafter: the same tensors) and layers N+1..L (written while verifying); the exit
layer keeps a one-layer cache of its own. Drafting feeds y_t, x_1, x_2, ... one at a time through
layers 1..N, then the exit layer, norm and head; the layer-N states H^N are kept. Verification runs
layers N+1..L only, over the stored H^N of [y_t, x_1..x_k] (a draft never fed during drafting, the
last one of a fixed-K chain, goes through layers 1..N first, as LayerSkip's forward_remainder).
`commit` cuts layers 1..L back to the accepted prefix; the drafter cuts the exit cache and feeds
accepted states it never saw (all drafts accepted) at the next round's start.

Chains only (EESD footnote 3: one top-1 candidate per step), fixed K or ended by any StopRule; a
stop rule gets `hidden_D` = the post-norm exit output after consuming the token (docs/methods/cali-ts.md §4).
A reduced exit head (model.draft_vocab) proposes through its d2t map like every other drafter
(propose_children: argmax over the draft ids mapped to target ids; at T > 0, q is zero elsewhere).

Legend: Q rows fed at once, D hidden size, V vocabulary (the head's: N draft ids when reduced), P committed positions.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from draftforge.decode.control import FixedChain
from draftforge.decode.methods.core import ChainOptions, chain_rows
from draftforge.decode.drafters.base import (
    Drafter,
    chain_stops,
    draft_map,
    propose_children,
    stack_q,
)
from draftforge.decode.engine import SpeculativeDecoder
from draftforge.decode.memory import cache_bytes
from draftforge.decode.methods import Method, register_method
from draftforge.decode.sampling import match_vocab
from draftforge.decode.targets import KVCacheTarget, Verification
from draftforge.decode.tree import DraftTree
from draftforge.decode.tree_shape import TreeShape
from draftforge.errors import DraftforgeError
from draftforge.models.eesd import (
    ExitHead,
    TargetParts,
    Trunk,
    causal_mask,
    check_exit_after,
    run_layers,
    split_target,
)


def crop_to(cache, keep: int) -> None:
    """Cut every layer of `cache` to its first `keep` positions (layers may hold different lengths)."""
    for layer in cache.layers:
        extra = layer.get_seq_length() - keep
        if extra > 0:
            layer.crop(-extra)


class EarlyExitTarget(KVCacheTarget):
    """A KV-cache target whose forward is split after layer N; verification starts at layer N+1 from the
    layer-N states the paired drafter stored. Without staged states it is plain decoding (split in two)."""

    def __init__(self, model, exit_after: int, tokenizer=None):
        super().__init__(model, tokenizer)
        self.parts: TargetParts = split_target(model)
        self.n = check_exit_after(exit_after, self.parts.num_layers, "exit_after_layer")
        self.shallow, self.deep = self.parts.layers[: self.n], self.parts.layers[self.n:]
        self.reset_states()

    def reset_states(self) -> None:
        self.hidden_N: list[torch.Tensor] = []  # H^N [D] of every committed position (the exit layer's input)
        self.staged_N: list[torch.Tensor] = []  # H^N of this round's rows the drafter already fed: y_t, x_1, ...

    @property
    def cache(self):
        """The one target cache; layers 1..N of it are what the drafter shares."""
        return self.lm.cache

    @property
    def shallow_length(self) -> int:
        return self.lm.cache.get_seq_length(0)

    @torch.inference_mode()
    def run_shallow(self, tokens: list[int]) -> torch.Tensor:
        """Append `tokens` to layers 1..N of the shared cache; their H^N [Q, D]."""
        start = self.shallow_length
        ids_1Q = torch.tensor([tokens], device=self.device)
        hidden_1QD = self.parts.embed(ids_1Q)
        position_ids_1Q = torch.arange(start, start + len(tokens), device=self.device)[None]
        rope = self.parts.rotary(hidden_1QD, position_ids_1Q)
        mask = causal_mask(self.parts.config, hidden_1QD, position_ids_1Q, self.cache, 0)
        return run_layers(self.shallow, hidden_1QD, position_ids_1Q, rope, mask, self.cache)[0]

    @torch.inference_mode()
    def run_deep(self, hidden_QD: torch.Tensor, start: int):
        """Layers N+1..L over H^N rows at positions start.. (appended to their cache); (logits [Q, V], final [Q, D])."""
        hidden_1QD = hidden_QD[None]
        position_ids_1Q = torch.arange(start, start + hidden_QD.shape[0], device=self.device)[None]
        rope = self.parts.rotary(hidden_1QD, position_ids_1Q)
        mask = causal_mask(self.parts.config, hidden_1QD, position_ids_1Q, self.cache, self.n)
        out_1QD = self.parts.norm(run_layers(self.deep, hidden_1QD, position_ids_1Q, rope, mask, self.cache))
        logits_QV = self.parts.head(out_1QD)[0]
        return (logits_QV.float() if logits_QV.dtype in (torch.float16, torch.bfloat16) else logits_QV), out_1QD[0]

    def prefill(self, seq: list[int]) -> None:
        self.lm.reset()
        self.last = None
        self.reset_states()
        if len(seq) > 1:
            prompt_N = self.run_shallow(seq[:-1])
            self.run_deep(prompt_N, 0)
            self.hidden_N = list(prompt_N.unbind(0))
        self.lm.length = len(seq) - 1

    def stage_drafted(self, last_token: int, drafts: list[int]) -> None:
        """What drafting `drafts` leaves for their verification (the eval's cost model times the verification
        alone): layers 1..N run over y_t and every draft but the last, which drafting never feeds."""
        self.staged_N = list(self.run_shallow([last_token] + drafts[:-1]).unbind(0)) if drafts else []

    def verify(self, last_token: int, tree: DraftTree) -> torch.Tensor:
        if len(tree) and not tree.is_chain:
            raise DraftforgeError("the early-exit target verifies chains only (EESD drafts one top-1 token per step)")
        start = self._verify_start = self.lm.length
        tokens = [last_token] + tree.tokens
        staged = self.staged_N[: len(tokens)]
        if self.shallow_length != start + len(staged):
            raise DraftforgeError("early-exit caches out of step: layers 1..N hold "
                                  f"{self.shallow_length} positions, expected {start + len(staged)}")
        rows = list(staged)
        if len(tokens) > len(staged):  # drafts never fed while drafting (the last of a fixed chain)
            rows += list(self.run_shallow(tokens[len(staged):]).unbind(0))
        self.verified_N = rows
        logits_NV, final_ND = self.run_deep(torch.stack(rows), start)
        self.lm.length = start + len(tokens)
        self.last = Verification(tree, logits_NV, final_ND if self.want_hidden else None)
        return logits_NV

    def commit(self, path: list[int]) -> None:
        keep = self._verify_start + 1 + len(path)
        if path != list(range(len(path))):
            raise DraftforgeError(f"the early-exit target commits chain prefixes only, got path {path}")
        crop_to(self.lm.cache, keep)  # layers 1..N and N+1..L alike
        self.lm.length = keep
        self.hidden_N += self.verified_N[: 1 + len(path)]
        self.staged_N = []
        self.last.path = list(path)


class EarlyExitDrafter(Drafter):
    """Drafts chains with the target's layers 1..N (shared cache) + the trained exit head (own cache)."""

    kind = "early_exit"
    hidden_after_token = True  # hidden_D after consuming draft i: the state that will choose draft i+1

    def __init__(self, exit_head: ExitHead, exit_after: int, vocab_size: int, tokenizer=None, metadata=None):
        self.exit_head, self.n, self.vocab_size = exit_head.eval(), exit_after, vocab_size
        self.model, self.tokenizer, self.metadata = exit_head, tokenizer, metadata or {}
        self.d2t = draft_map(exit_head, vocab_size)  # a reduced head's target ids (checked), else None
        self._paired: dict[int, EarlyExitTarget] = {}
        self.reset()

    def paired_target(self, target) -> EarlyExitTarget:
        """The early-exit target over `target`'s model (made once per target), and bind to it: load_early_exit
        pairs the head with its target this way, so every method verifies through the split forward."""
        if isinstance(target, EarlyExitTarget):
            paired = target
        else:
            paired = self._paired.get(id(target))
            if paired is None:
                paired = self._paired[id(target)] = EarlyExitTarget(target.model, self.n, target.tokenizer)
        self.bind(paired)
        return paired

    def attach(self, target) -> EarlyExitTarget:
        return self.paired_target(target)

    def reset(self) -> None:
        self.cache = DynamicCache()  # the exit layer's own cache (one layer)
        self.ee_length = 0  # positions in it

    def cache_bytes(self) -> int:
        """The exit layer's own KV cache (layers 1..N are the target's, counted there)."""
        return cache_bytes(self.cache)

    def _target(self) -> EarlyExitTarget:
        if not isinstance(self.target, EarlyExitTarget):
            raise DraftforgeError("the early-exit drafter verifies through its paired target: build the decoder "
                                  "with build_decoder(method, target, drafter) or use drafter.paired_target(target)")
        return self.target

    @torch.inference_mode()
    def _exit(self, rows_QD: torch.Tensor):
        """H^N rows at positions ee_length.. through the exit head; (logits [1, V], post-norm state [D]) of the last."""
        start, head = self.ee_length, self.exit_head
        hidden_1QD = rows_QD[None].to(head.lm_head.weight.dtype)
        position_ids_1Q = torch.arange(start, start + rows_QD.shape[0], device=rows_QD.device)[None]
        rope = mask = None
        if head.layer is not None:
            rope = self.target.parts.rotary(hidden_1QD, position_ids_1Q)
            mask = causal_mask(self.target.parts.config, hidden_1QD, position_ids_1Q, self.cache, 0)
        cache = self.cache if head.layer is not None else None
        logits_1QV, normed_1QD = head(hidden_1QD, position_ids_1Q, rope, mask, cache)
        self.ee_length += rows_QD.shape[0]
        return logits_1QV[0, -1:].float(), normed_1QD[0, -1]

    def _feed(self, token: int):
        """One token through layers 1..N (shared cache) and the exit head; staged for verification."""
        target = self._target()
        row_D = target.run_shallow([token])[0]
        target.staged_N.append(row_D)
        return self._exit(row_D[None])

    def draft_levels(self, seq, shape: TreeShape, params, generator, stop=None) -> DraftTree:
        if not shape.is_chain:
            raise DraftforgeError(f"the early-exit drafter drafts chains (EESD: one top-1 token per step), not the "
                                  f"tree {shape.name}; use a chain (--chain-length) or a stop rule")
        target = self._target()
        committed = len(seq) - 1  # seq[-1] (y_t) is fed now
        if target.shallow_length != committed or len(target.hidden_N) != committed:
            raise DraftforgeError("the early-exit drafter is out of step with its target (was a round skipped?)")
        self.ee_length = min(self.ee_length, committed)
        crop_to(self.cache, self.ee_length)
        backlog = target.hidden_N[self.ee_length:]  # committed states the exit layer has not seen yet
        row_D = target.run_shallow([seq[-1]])[0]
        target.staged_N = [row_D]
        logits_1V, _ = self._exit(torch.stack(backlog + [row_D]))
        tokens, q_rows = [], []
        for depth in range(1, shape.depth + 1):
            child_11, q_1V = propose_children(logits_1V, 1, params, self.vocab_size, generator, self.d2t)
            tokens.append(int(child_11[0, 0]))
            q_rows.append(q_1V)
            if depth == shape.depth:
                break
            next_logits_1V, hidden_D = self._feed(tokens[-1])
            if chain_stops(stop, depth, child_11, logits_1V, q_1V, hidden_D, self.vocab_size, self.d2t):
                break
            logits_1V = next_logits_1V
        self.round_start = committed
        q_probs = None if params.greedy else stack_q(q_rows, len(tokens))
        n = len(tokens)
        return DraftTree(tokens, list(range(-1, n - 1)), list(range(1, n + 1)), q_probs, is_chain=True)

    def accept_levels(self, path: list[int]) -> None:
        # y_t and the accepted drafts the exit layer saw stay valid (their inputs were exact target states)
        self.ee_length = min(self.ee_length, self.round_start + 1 + len(path))
        crop_to(self.cache, self.ee_length)

    @property
    def steps_per_draft(self) -> str:
        return f"layers 1..{self.n} of the target + the exit head per drafted token"

    @torch.inference_mode()
    def teacher_forced(self, ids_1S: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits over the target's vocabulary [S, V], post-norm exit states [S, D]) of a whole sequence: the
        target's layers 1..N, then the exit head, no caches (the θ harvest; decoding gives the same rows)."""
        ids_1S = ids_1S.to(self.exit_head.device)
        hidden_1SD, position_ids_1S, rope, mask = Trunk(self._target().parts, self.n)(ids_1S)
        logits_1SV, normed_1SD = self.exit_head(hidden_1SD.to(self.exit_head.lm_head.weight.dtype), position_ids_1S,
                                                rope, mask)
        return match_vocab(logits_1SV[0].float(), self.vocab_size, self.d2t), normed_1SD[0].float()


def load_early_exit(path, target, device="cpu", dtype=None) -> EarlyExitDrafter:
    """An EESD export attached to `target` (refused for another target: fingerprint of the frozen part)."""
    from draftforge.models.eesd_export import load_exit_head

    head, meta, tokenizer = load_exit_head(path, target.model)
    head = head.to(device=device, dtype=dtype or target.model.dtype)
    drafter = EarlyExitDrafter(head, meta["exit_after_layer"], target.vocab_size, tokenizer, meta)
    drafter.paired_target(target)
    return drafter


def make_eesd_decoder(target, drafter, controller, name: str = "eesd"):
    """A SpeculativeDecoder of the early-exit drafter over its paired target (refuses other drafters)."""
    if not isinstance(drafter, EarlyExitDrafter):
        raise DraftforgeError(f"method {name!r} needs an EESD exit head as drafter (an export of task eesd), got a "
                              f"{getattr(drafter, 'kind', type(drafter).__name__)!r} drafter; use method chain for it")
    return SpeculativeDecoder(name, drafter.paired_target(target), drafter, controller)


# ---------------------------------------------------------------- the method (chain_length: core_methods.py's option)

register_method(Method("eesd", "EESD early-exit drafter (an eesd export): a chain of --chain-length drafts from the "
                       "target's first N layers + exit head, verified by layers N+1..L", True,
                       lambda target, drafter, o: make_eesd_decoder(target, drafter, FixedChain(o.chain_length)),
                       ChainOptions, rows=chain_rows))
