"""The growing KV cache (decode/targets/growing_cache.py) against transformers' DynamicCache (torch.cat): the same
logits bitwise through prefill, chain and tree verification with trimming, and growth past its capacity."""

from __future__ import annotations

import pytest
import torch

from draftforge.decode.targets import KVCacheTarget
from draftforge.decode.targets import growing_cache
from draftforge.decode.tree import DraftTree
from draftforge.kernels import kv_buffer
from tests.fixtures.decode import tiny_llama

VOCAB = 64


@pytest.mark.skipif(growing_cache.DynamicLayer is None, reason="this transformers has no per-layer cache objects")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_growing_cache_gives_the_logits_of_torch_cat_bitwise(monkeypatch, dtype):
    model = tiny_llama(vocab=VOCAB, layers=2, hidden=32, dtype=dtype, ctx=1024)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, VOCAB, (13,), generator=gen).tolist()
    monkeypatch.setattr(growing_cache, "MIN_CAPACITY", 8)  # so the rounds below cross several regrowths
    monkeypatch.setattr(kv_buffer, "MIN_SPARE", 1)
    capacities = set()
    grown = KVCacheTarget(model)
    grown.prefill(prompt)  # (prefill starts a fresh cache)
    assert all(type(layer).__name__ == "GrowingLayer" for layer in grown.lm.cache.layers)
    monkeypatch.setattr("draftforge.decode.targets.growing", lambda cache: cache)  # transformers' own layers
    plain = KVCacheTarget(model)
    plain.prefill(prompt)
    assert all(type(layer).__name__ == "DynamicLayer" for layer in plain.lm.cache.layers)
    last = prompt[-1]
    for round_ in range(40):
        tokens = torch.randint(0, VOCAB, (5,), generator=gen).tolist()
        if round_ % 2:
            tree = DraftTree(tokens, [-1, -1, 0, 1, 3], [1, 1, 2, 2, 3])
            path = [[1, 3, 4], [0, 2], [], [1]][round_ % 4]
        else:
            tree = DraftTree(tokens[:3], [-1, 0, 1], [1, 2, 3])
            path = list(range(round_ % 4))
        got, want = grown.verify(last, tree), plain.verify(last, tree)
        assert torch.equal(got, want), f"round {round_}"
        grown.commit(path)
        plain.commit(path)
        capacities.add(grown.lm.cache.layers[0].keys_BHCD.shape[-2])
        last = tree.tokens[path[-1]] if path else (last + 1) % VOCAB
    assert grown.lm.length == plain.lm.length == grown.lm.cache.layers[0].get_seq_length()
    assert grown.lm.cache.layers[0].keys_BHCD.shape[-2] >= grown.lm.length > 64
    assert len(capacities) >= 4  # regrown at least three times during the rounds


def test_a_full_buffer_grows_by_an_eighth_and_a_prompt_gets_its_spare_rows_at_once():
    buf = kv_buffer.GrowingKV(2, 4, torch.float32, "cpu", capacity=16)
    rows = torch.arange(1000 * 2 * 4, dtype=torch.float32).view(2, 1000, 4)
    buf.append(rows, -rows)  # a prompt: 1000 rows into a 16-row buffer
    assert buf.k.shape == (2, 1000 + 1000 // 8, 4) and buf.length == 1000
    for i in range(125):  # the spare rows take 125 decoded tokens without a reallocation
        before = buf.k
        buf.append(rows[:, i:i + 1], -rows[:, i:i + 1])
        assert buf.k is before
    buf.append(rows[:, :1], -rows[:, :1])  # the 126th grows it: 1126 + 1126 // 8
    assert buf.k.shape[-2] == 1126 + 140 and buf.length == 1126
    k, v = buf.view()
    assert torch.equal(k[:, :1000], rows) and torch.equal(v[:, 1000:1125], -rows[:, :125])
    small = kv_buffer.GrowingKV(1, 4, torch.float32, "cpu", capacity=2)
    small.append(torch.ones(1, 3, 4), torch.ones(1, 3, 4))
    assert small.k.shape[-2] == 3 + 64  # at least 64 spare rows (kv_buffer.MIN_SPARE)
