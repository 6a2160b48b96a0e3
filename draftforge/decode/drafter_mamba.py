"""Mamba / Mamba2 drafter: O(1) recurrent state, chain and tree drafting by batch expansion.

The prompt is encoded once; afterwards every committed token is fed with the single-token
recurrent step (transformers' Mamba1 multi-token path does not continue from a cached SSM state,
so single steps are also the only correct choice there). Rollback restores the saved state of the
deepest accepted draft node: the prefix is never re-encoded (Mamba Drafters §4.1).

Legend: B nodes at one depth, V vocabulary.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache

from draftforge.decode.drafter_hf import _stack_q
from draftforge.decode.drafters import Drafter, propose_children
from draftforge.decode.sampling import SamplingParams
from draftforge.decode.ssm_state import StateBank, layer_states, point_cache_at
from draftforge.decode.tree import DraftTree, level_sizes, tree_from_levels


class MambaDrafter(Drafter):
    kind = "mamba"

    def __init__(self, model, vocab_size: int, tokenizer=None):
        self.model, self.tokenizer, self.vocab_size = model, tokenizer, vocab_size
        self.banks: dict[tuple[int, ...], StateBank] = {}  # one per configuration, kept across prompts
        self.reset()

    def reset(self) -> None:
        self.cache = None
        self.consumed = 0  # committed tokens folded into the live state
        self.last_logits_V = None

    @torch.inference_mode()
    def _step(self, tokens_B1: torch.Tensor) -> torch.Tensor:
        out = self.model(input_ids=tokens_B1, cache_params=self.cache, use_cache=True)
        self.cache = out.cache_params
        return out.logits[:, -1]

    def _sync(self, seq: list[int]) -> torch.Tensor:
        """Fold unseen committed tokens into the live state; return logits after seq[-1]."""
        device = self.model.device
        if self.cache is None:
            self.cache = DynamicCache(config=self.model.config)
            self.last_logits_V = self._step(torch.tensor([seq], device=device))[0]
        else:
            for tok in seq[self.consumed :]:
                self.last_logits_V = self._step(torch.tensor([[tok]], device=device))[0]
        self.consumed = len(seq)
        return self.last_logits_V

    def _bank(self, widths):
        bank = self.banks.get(widths)
        if bank is None:
            bank = self.banks[widths] = StateBank(widths, layer_states(self.cache))
        return bank

    @torch.inference_mode()
    def draft(self, seq, widths, params: SamplingParams, generator) -> DraftTree:
        logits_BV = self._sync(seq)[None]
        self.live = layer_states(self.cache)
        self.bank, self.widths = self._bank(widths), widths
        self.bank.save_root(self.live)
        levels, q_rows = [], []
        for depth, width in enumerate(widths, start=1):
            children_BW, q_BV = propose_children(logits_BV, width, params, self.vocab_size, generator)
            levels.append(children_BW.flatten().tolist())
            q_rows.append(q_BV)
            if depth == len(widths):
                break
            self.bank.expand(self.cache, depth)
            logits_BV = self._step(children_BW.reshape(-1, 1))
        point_cache_at(self.cache, self.live)
        tokens, parents, depths = tree_from_levels(levels, widths)
        q_probs = None if params.greedy else _stack_q(q_rows, len(tokens))
        return DraftTree(tokens, parents, depths, q_probs, is_chain=all(w == 1 for w in widths))

    @torch.inference_mode()
    def accept(self, path: list[int]) -> None:
        """Restore the state after the deepest accepted node that was fed (depth < γ)."""
        fed = min(len(path), len(self.widths) - 1)
        if fed == 0:
            self.bank.restore(self.cache, self.live, 0, 0)
        else:
            level_start = sum(level_sizes(self.widths)[: fed - 1])
            self.bank.restore(self.cache, self.live, fed, path[fed - 1] - level_start)
        self.consumed = self.consumed + fed
