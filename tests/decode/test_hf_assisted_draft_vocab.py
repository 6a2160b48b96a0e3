"""HF assisted generation with a reduced-vocabulary drafter: drafts are target ids, and T>0 runs (issue 10)."""

from __future__ import annotations

import copy

import torch

from draftforge.decode import build_decoder, load_drafter, load_target
from draftforge.models.draft_vocab import attach_reduced_head
from tests.fixtures.decode import greedy_reference, tiny_llama

VOCAB = 16


def _self_drafter(target_model, tmp_path):
    """The target itself with a reduced head over every id in a shuffled order: its mapped logits are the target's."""
    perm = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(1)).tolist()
    model = attach_reduced_head(copy.deepcopy(target_model), perm)
    model.save_pretrained(tmp_path)
    return perm


def test_hf_assisted_maps_draft_ids_to_target_ids(tmp_path):
    target_model = tiny_llama(vocab=VOCAB, dtype=torch.float64)
    target = load_target(target_model)
    _self_drafter(target_model, tmp_path)
    drafter = load_drafter(tmp_path, target, dtype=torch.float64)
    dec = build_decoder("hf_assisted", target, drafter)
    prompt = [3, 5, 7, 1]
    res = dec.generate(prompt, max_new_tokens=12)
    assert res.tokens == greedy_reference(target, prompt, 12)
    # a drafter equal to the target (through its d2t map) is nearly always accepted; unmapped draft ids
    # (draft-head row numbers taken as target ids) were accepted 0 times in 12 rounds
    assert sum(res.stats.accepted_per_round) >= 0.6 * sum(res.stats.drafted_per_round) > 0
    sampled = dec.generate(prompt, max_new_tokens=12, temperature=1.0, seed=3)  # crashed: q was 8k wide, p 49k
    assert len(sampled.tokens) == 12 and all(0 <= t < VOCAB for t in sampled.tokens)
