"""Tiny random hybrid (Mamba2 + attention) and SSM targets for the hybrid harness tests (no network)."""

from __future__ import annotations

import torch
from transformers import (
    BambaConfig, BambaForCausalLM, GraniteMoeHybridConfig, GraniteMoeHybridForCausalLM, JambaConfig,
    JambaForCausalLM, Mamba2Config, Mamba2ForCausalLM, NemotronHConfig, NemotronHForCausalLM, Zamba2Config,
    Zamba2ForCausalLM,
)

MAMBA = dict(n_heads=4, d_head=16, n_groups=2, d_state=8, d_conv=4, expand=2, chunk=8)


def _finish(model, dtype, seed):
    """Random SSM constants (not the init: A_log, dt_bias, D all equal would hide indexing bugs)."""
    torch.manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("A_log", "dt_bias", "D")):
                p.copy_(torch.randn_like(p) * 0.5)
    model = model.to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def tiny_bamba(vocab=48, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = MAMBA
    config = BambaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1, 3], mamba_n_heads=m["n_heads"], mamba_d_head=m["d_head"],
        mamba_n_groups=m["n_groups"], mamba_d_state=m["d_state"], mamba_d_conv=m["d_conv"],
        mamba_expand=m["expand"], mamba_chunk_size=m["chunk"], max_position_embeddings=256,
        pad_token_id=None, eos_token_id=None, bos_token_id=None,
    )
    return _finish(BambaForCausalLM(config), dtype, seed)


def tiny_nemotron_h(vocab=48, seed=1, dtype=torch.float32):
    torch.manual_seed(seed)
    m = MAMBA
    config = NemotronHConfig(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=5, hybrid_override_pattern="M*M-M",
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=64,
        mamba_num_heads=m["n_heads"], mamba_head_dim=m["d_head"], n_groups=m["n_groups"],
        ssm_state_size=m["d_state"], conv_kernel=m["d_conv"], chunk_size=m["chunk"], expand=2,
        max_position_embeddings=256, pad_token_id=None, eos_token_id=None, bos_token_id=None,
    )
    return _finish(NemotronHForCausalLM(config), dtype, seed)


def tiny_granite_hybrid(vocab=48, seed=2, dtype=torch.float32):
    torch.manual_seed(seed)
    m = MAMBA
    config = GraniteMoeHybridConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["mamba", "attention", "mamba", "mamba"],
        mamba_n_heads=m["n_heads"], mamba_d_head=m["d_head"], mamba_n_groups=m["n_groups"],
        mamba_d_state=m["d_state"], mamba_d_conv=m["d_conv"], mamba_expand=m["expand"],
        mamba_chunk_size=m["chunk"], num_local_experts=0, max_position_embeddings=256,
        pad_token_id=None, eos_token_id=None, bos_token_id=None,
    )
    return _finish(GraniteMoeHybridForCausalLM(config), dtype, seed)


def tiny_zamba2(vocab=48, seed=3, dtype=torch.float32):
    torch.manual_seed(seed)
    config = Zamba2Config(
        vocab_size=vocab, hidden_size=32, num_hidden_layers=4, layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
        num_attention_heads=4, num_key_value_heads=4, mamba_d_state=8, mamba_headdim=16, mamba_ngroups=2,
        n_mamba_heads=4, intermediate_size=64, use_mem_rope=True, max_position_embeddings=256,
        pad_token_id=None, eos_token_id=None, bos_token_id=None,
    )
    return _finish(Zamba2ForCausalLM(config), dtype, seed)


def tiny_mamba2_target(vocab=48, seed=4, dtype=torch.float32):
    torch.manual_seed(seed)
    m = MAMBA
    config = Mamba2Config(
        vocab_size=vocab, hidden_size=32, state_size=m["d_state"], num_hidden_layers=3, expand=2,
        conv_kernel=m["d_conv"], num_heads=m["n_heads"], head_dim=16, n_groups=m["n_groups"],
        chunk_size=m["chunk"], pad_token_id=None, eos_token_id=None, bos_token_id=None,
    )
    return _finish(Mamba2ForCausalLM(config), dtype, seed)


def tiny_jamba(vocab=48, seed=5, dtype=torch.float32):
    torch.manual_seed(seed)
    config = JambaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        num_experts=1, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=4,
        pad_token_id=None, eos_token_id=None, bos_token_id=None,
    )
    return JambaForCausalLM(config).to(dtype).eval()


HYBRIDS = {"bamba": tiny_bamba, "nemotron_h": tiny_nemotron_h, "granitemoehybrid": tiny_granite_hybrid,
           "zamba2": tiny_zamba2, "mamba2": tiny_mamba2_target}


class ScriptedDrafter:
    """A greedy-only test drafter that knows the target's true continuation (its own generate()) and
    puts it in the tree with deliberate misses, so deep accepts, partial rejections and non-first
    children are all exercised on random targets (a random drafter would almost never be accepted)."""

    kind = "scripted"
    node_map = None
    d2t = None

    def __init__(self, target, seed=0, miss=0.2, second=0.2):
        self.target, self.vocab_size = target, target.vocab_size
        self.gen, self.miss, self.second = torch.Generator().manual_seed(seed), miss, second

    def reset(self):
        pass

    def _truth(self, seq, depth):
        ids = torch.tensor([seq])
        out = self.target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=depth,
                                         do_sample=False, eos_token_id=None)
        return out[0, len(seq):].tolist()

    def draft(self, seq, plan, params, generator):
        from draftforge.decode.plan import as_plan
        from draftforge.decode.tree import DraftTree
        from draftforge.decode.tree_shape import as_shape

        plan = as_plan(plan)
        shape = as_shape(plan.tree if hasattr(plan, "tree") else (1,) * plan.max_len)
        truth = self._truth(seq, shape.depth)
        levels, on_line = [], 0  # on_line: the node at this depth that continues the true path (-1: none)
        for depth, layer in enumerate(shape.layers):
            rnd = torch.randint(0, self.vocab_size, (len(layer),), generator=self.gen).tolist()
            kids = [k for k, p in enumerate(layer) if p == on_line] if on_line >= 0 else []
            slot = -1
            if kids and float(torch.rand((), generator=self.gen)) >= self.miss:
                slot = kids[0]
                if len(kids) > 1 and float(torch.rand((), generator=self.gen)) < self.second:
                    slot = kids[1]
            row_truth = truth[depth]
            for r in range(len(layer)):  # siblings of the truth must differ from it
                if r != slot and rnd[r] == row_truth:
                    rnd[r] = (row_truth + 1) % self.vocab_size
            if slot >= 0:
                rnd[slot] = row_truth
            levels.append(rnd)
            on_line = slot
        tokens, parents, depths = shape.flatten(levels)
        return DraftTree(tokens, parents, depths, is_chain=shape.is_chain)

    def accept(self, path):
        pass
