"""Tiny random models for the decode tests (built in code, no network)."""

from __future__ import annotations

import torch
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    Mamba2Config,
    Mamba2ForCausalLM,
    MambaConfig,
    MambaForCausalLM,
)

from draftforge.decode.control import Controller


def tiny_llama(vocab=64, seed=0, layers=2, hidden=32, dtype=torch.float32, ctx=256):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=ctx,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def tiny_mamba(vocab=64, seed=1, dtype=torch.float32):
    torch.manual_seed(seed)
    config = MambaConfig(vocab_size=vocab, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4)
    return MambaForCausalLM(config).to(dtype).eval()


def tiny_mamba2(vocab=64, seed=2, dtype=torch.float32):
    torch.manual_seed(seed)
    config = Mamba2Config(
        vocab_size=vocab, hidden_size=32, state_size=8, num_hidden_layers=2, expand=2, conv_kernel=4,
        num_heads=4, head_dim=16, n_groups=1, chunk_size=16,
    )
    return Mamba2ForCausalLM(config).to(dtype).eval()


def noisy_copy(model, noise=0.02, seed=9):
    """A drafter that mostly agrees with `model` (so drafts get accepted) but not always."""
    import copy

    torch.manual_seed(seed)
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for p in clone.parameters():
            p.add_(noise * torch.randn_like(p))
    return clone


def greedy_reference(target, prompt, max_new, eos=None):
    """The target's own greedy generate() continuation (the lossless oracle)."""
    ids = torch.tensor([prompt])  # explicit mask: generate() would otherwise mask prompt tokens equal to pad
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False,
                                eos_token_id=eos)
    return out[0, len(prompt) :].tolist()


def three_drafters(target, vocab):
    """A Transformer (noisy copy of the target), a Mamba and a Mamba2 drafter, float64, bound to `target`."""
    from draftforge.decode import load_drafter

    return {
        "transformer": load_drafter(noisy_copy(target.model, noise=0.05), target),
        "mamba": load_drafter(tiny_mamba(vocab=vocab, dtype=torch.float64), target),
        "mamba2": load_drafter(tiny_mamba2(vocab=vocab, dtype=torch.float64), target),
    }


class PlanController(Controller):
    """A controller that hands the drafter the same plan every round and records each Round."""

    def __init__(self, plan):
        self.plan, self.rounds = plan, []

    def next_plan(self):
        return self.plan

    def feedback(self, rnd):
        self.rounds.append(rnd)
