"""The context state a decode reports holding (DecodeStats.target_cache_bytes / drafter_state_bytes): each equals
a hand computation from the model's config and the tokens held, KV caches grow with the context and recurrent
states do not."""

from __future__ import annotations

import pytest
import torch

from draftforge.decode import build_decoder, load_drafter, load_target
from draftforge.decode.memory import cache_bytes
from tests.fixtures.decode import feature_mamba_head, noisy_copy, tiny_llama, tiny_mamba2
from tests.fixtures.hybrid import tiny_bamba

VOCAB = 64
F64 = 8  # bytes per float64


def kv_bytes(config, tokens: int) -> int:
    """2 (K and V) x layers x kv heads x tokens x head dim, float64."""
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * tokens * head_dim * F64


def mamba2_state_bytes(config) -> int:
    """Per layer: the conv window over x, B and C in the model's float64, and the SSM state heads x head dim x
    state, which transformers' Mamba2 keeps in float32 whatever the model's dtype."""
    inner = config.expand * config.hidden_size
    conv = (inner + 2 * config.n_groups * config.state_size) * config.conv_kernel
    ssm = config.num_heads * config.head_dim * config.state_size
    return config.num_hidden_layers * (conv * F64 + ssm * 4)


@pytest.fixture(scope="module")
def target():
    return load_target(tiny_llama(vocab=VOCAB, dtype=torch.float64))


def prompt(n: int) -> list[int]:
    return [(7 * i + 3) % VOCAB for i in range(n)]


@pytest.mark.parametrize("method", ["ar", "chain", "tree"])
def test_target_kv_bytes_are_the_tokens_held(target, method):
    drafter = None if method == "ar" else load_drafter(noisy_copy(target.model, noise=0.05), target)
    dec = build_decoder(method, target, drafter)
    for n in (10, 40):
        stats = dec.generate(prompt(n), max_new_tokens=12).stats
        # the target holds every committed token but the last emitted one (the next round's verify feeds it)
        assert target.lm.length == n + stats.new_tokens - 1
        assert stats.target_cache_bytes == kv_bytes(target.model.config, target.lm.length)


def test_a_transformer_drafters_cache_grows_and_a_mamba2_state_does_not(target):
    llama = load_drafter(noisy_copy(target.model, noise=0.05), target)
    mamba2 = load_drafter(tiny_mamba2(vocab=VOCAB, dtype=torch.float64), target)
    held = {}
    for name, drafter in (("llama", llama), ("mamba2", mamba2)):
        dec = build_decoder("chain", target, drafter)
        held[name] = [dec.generate(prompt(n), max_new_tokens=8).stats.drafter_state_bytes for n in (10, 80)]
    assert held["mamba2"][0] == held["mamba2"][1] == mamba2_state_bytes(mamba2.model.config)
    assert held["llama"][1] > held["llama"][0] > 0
    # the drafter's cache ends holding the tokens it has read: between the prompt and prompt + new tokens
    cfg = llama.model.config
    assert kv_bytes(cfg, 80) <= held["llama"][1] <= kv_bytes(cfg, 80 + 8)


def test_feature_mamba2_state_is_flat_and_prompt_lookup_reports_none(target):
    fm = load_drafter(feature_mamba_head(target.model), target)
    dec = build_decoder("chain", target, fm)
    sizes = [dec.generate(prompt(n), max_new_tokens=8).stats.drafter_state_bytes for n in (10, 80)]
    # per block: the conv window (kernel - 1 rows of x, B and C) and the SSM state heads x head dim x state, both in
    # the model's float64 (the scan's state is float32 at least)
    c = fm.model.config
    inner = c.expand * c.hidden_size
    by_hand = c.layers * ((c.conv_kernel - 1) * (inner + 2 * c.state_size) + inner * c.state_size) * F64
    assert sizes[0] == sizes[1] == by_hand
    lookup = build_decoder("chain", target, load_drafter("prompt-lookup", target))
    assert lookup.generate(prompt(10), max_new_tokens=8).stats.drafter_state_bytes is None


def test_hybrid_target_counts_its_attention_kv_and_its_ssm_states():
    target = load_target(tiny_bamba())  # float32: the tree scan takes no float64
    stats = build_decoder("ar", target, None).generate([1, 2, 3, 4, 5, 6], max_new_tokens=6).stats
    c, f32 = target.model.config, 4
    held = 6 + 6 - 1  # prompt + emitted, but the last emitted token
    head_dim = c.hidden_size // c.num_attention_heads
    attention = len(c.attn_layer_indices) * 2 * c.num_key_value_heads * held * head_dim * f32
    inner = c.mamba_expand * c.hidden_size
    conv = (inner + 2 * c.mamba_n_groups * c.mamba_d_state) * c.mamba_d_conv
    ssm = c.mamba_n_heads * c.mamba_d_head * c.mamba_d_state
    mamba = (c.num_hidden_layers - len(c.attn_layer_indices)) * (conv + ssm) * f32
    assert stats.target_cache_bytes == attention + mamba == cache_bytes(target.cache)
