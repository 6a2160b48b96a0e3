"""Greedy speculative output must equal the target's own generate(do_sample=False), token for token."""

from __future__ import annotations

import pytest
import torch

from draftforge.decode import build_decoder, load_drafter, load_target, parse_tree
from draftforge.errors import DraftforgeError
from tests.fixtures.decode import (assert_stops_at_eos, greedy_reference, greedy_runs, late_eos, noisy_copy,
                                   tiny_llama, tiny_mamba, tiny_mamba2)

VOCAB = 12
PROMPTS = [[4], [3, 5, 7], [(7 * i + 3) % VOCAB for i in range(23)]]


reference = greedy_reference


# (VOCAB, 2, 1) always accepts depth 1, so deep rollback paths are exercised even with random drafters;
# stree13 is STree's 13-token tree (parent lists: nodes at one depth have 2, 1 or 0 children)
STREE13 = parse_tree("stree13")
METHODS = [("chain", {"chain_length": 3}), ("tree", {"tree": (2, 2, 1)}), ("tree", {"tree": (VOCAB, 2, 1)}),
           ("ucb", {"ucb_trees": [(1, 1), (3, 2), (VOCAB, 1, 1)]}), ("tree", {"tree": STREE13}),
           ("ucb", {"ucb_trees": [(1, 1), STREE13, "parents:0,0,0/0,2,2/1"]})]


@pytest.mark.parametrize("kind", ["transformer", "mamba", "mamba2", "eagle3", "feature_mamba2"])
@pytest.mark.parametrize("method,options", METHODS, ids=["chain3", "tree221", "treeV21", "ucb", "stree13",
                                                         "ucb_shapes"])
def test_greedy_equals_generate(target, drafters, kind, method, options):
    dec = build_decoder(method, target, drafters[kind], **options)
    accepted = 0
    for max_new, res in greedy_runs(dec, target, PROMPTS, (1, 13)):  # 13 lands mid-draft for every config above
        assert res.stats.new_tokens == max_new == sum(res.stats.accepted_per_round) + res.stats.target_forwards
        accepted += sum(res.stats.accepted_per_round)
    assert accepted > 0  # the comparison went through accepted drafts, not only corrections


@pytest.mark.parametrize("kind", ["transformer", "mamba"])
def test_eos_inside_draft_stops_like_generate(target, drafters, kind):
    prompt = PROMPTS[1]
    eos = late_eos(reference(target, prompt, 20))  # first emitted mid-sequence; the draft tree often contains it
    dec = build_decoder("tree", target, drafters[kind], tree=(VOCAB, 2, 1))
    assert_stops_at_eos(dec, target, prompt, eos)


def test_ar_and_hf_assisted_equal_generate(target, drafters):
    for method in ("ar", "hf_assisted"):
        dec = build_decoder(method, target, drafters["transformer"])
        for prompt in PROMPTS:
            res = dec.generate(prompt, max_new_tokens=9)
            assert res.tokens == reference(target, prompt, 9), method
            assert res.stats.target_forwards > 0 and res.stats.new_tokens == 9


def test_empty_eos_set_ignores_the_model_eos_for_every_method(target, drafters):
    """eos_token_id=[] (eval --ignore-eos) generates max_new_tokens even past the model's own EOS."""
    prompt = PROMPTS[1]
    free = reference(target, prompt, 12)
    config = target.model.generation_config
    saved = config.eos_token_id
    config.eos_token_id = free[3]  # the model's EOS is now a token it emits early
    try:
        ids = torch.tensor([prompt])
        stopped = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False)
        assert stopped.shape[1] - len(prompt) < 12  # generate() with the model's defaults stops on it ...
        assert build_decoder("ar", target).generate(prompt, max_new_tokens=12).tokens == stopped[0, len(prompt):].tolist()
        for method, drafter in [("ar", None), ("chain", "mamba"), ("tree", "transformer"), ("hf_assisted", "transformer")]:
            dec = build_decoder(method, target, drafters.get(drafter))
            res = dec.generate(prompt, max_new_tokens=12, eos_token_id=[])
            assert res.tokens == free, method  # ... every method with the empty set does not
    finally:
        config.eos_token_id = saved


def test_float32_chain_agrees(target):
    target32 = load_target(tiny_llama(vocab=VOCAB, dtype=torch.float32))
    drafter = load_drafter(noisy_copy(target32.model, noise=0.05), target32)
    res = build_decoder("chain", target32, drafter, chain_length=4).generate(PROMPTS[2], max_new_tokens=16)
    assert res.tokens == reference(target32, PROMPTS[2], 16)


def test_hf_assisted_counts_an_accepted_eos_draft_as_accepted(target):
    """A round whose accepted drafts end in EOS emits no bonus token. Oracle: with a drafter equal to the target
    (float64), every draft is accepted, so the target itself chose one token per round but the last, which stopped
    on a drafted EOS: new tokens = accepted drafts + rounds - 1, and every round accepted what it drafted."""
    prompt = PROMPTS[2]
    eos = late_eos(reference(target, prompt, 20), at_least=6)
    dec = build_decoder("hf_assisted", target, load_drafter(noisy_copy(target.model, noise=0.0), target))
    res = dec.generate(prompt, max_new_tokens=20, eos_token_id=eos)
    assert res.tokens == reference(target, prompt, 20, eos=eos) and res.tokens[-1] == eos
    assert res.stats.accepted_per_round == res.stats.drafted_per_round and res.stats.drafted_per_round[-1] >= 1
    assert res.stats.new_tokens == sum(res.stats.accepted_per_round) + res.stats.target_forwards - 1


def test_hf_assisted_counts_rounds_of_any_number_of_drafts(target):
    """transformers' draft length has no cap of its own (the heuristic schedule grows it by 2 after every fully
    accepted round): a first round of 150 drafts is counted whole, and every round emits its accepted drafts and
    one token of the target's (no EOS here)."""
    model = noisy_copy(target.model, noise=0.0)
    model.generation_config.num_assistant_tokens = 150
    model.generation_config.num_assistant_tokens_schedule = "constant"
    model.generation_config.assistant_confidence_threshold = 0.0  # no early stop on this random model's low p
    dec = build_decoder("hf_assisted", target, load_drafter(model, target))
    res = dec.generate(PROMPTS[2], max_new_tokens=200)
    assert res.tokens == reference(target, PROMPTS[2], 200)
    assert res.stats.drafted_per_round[0] == 150
    assert res.stats.new_tokens == sum(res.stats.accepted_per_round) + res.stats.target_forwards


@pytest.mark.parametrize("kind", ["mamba", "mamba2"])
def test_hf_assisted_runs_a_mamba_drafter_from_transformers_5_25(target, kind):
    """transformers 5.25 records an SSM assistant's states while it drafts and crops back after a rejection. Oracle
    for that rollback: every round drafts what a fresh copy of the drafter, run without a cache over the committed
    text, drafts greedily (a state left one token off drafts other tokens; the output would still be lossless).
    Mamba2's drafts show a rollback that keeps the rejected drafts' state (that mutant fails here); tiny_mamba's
    argmax barely reads its SSM state, so for Mamba the check is the output and drafts equal to a fresh run."""
    from draftforge.hfcompat import assisted_generation_rolls_back_ssm

    model = (tiny_mamba if kind == "mamba" else tiny_mamba2)(vocab=VOCAB, dtype=torch.float64)
    drafter = load_drafter(model, target)
    if not assisted_generation_rolls_back_ssm():
        with pytest.raises(DraftforgeError, match=r"needs transformers >= 5\.25 \(installed: "):
            build_decoder("hf_assisted", target, drafter)
        pytest.skip("transformers < 5.25 cannot run a Mamba assistant (refusal checked)")
    config = model.generation_config
    config.num_assistant_tokens, config.num_assistant_tokens_schedule = 3, "constant"
    config.assistant_confidence_threshold = 0.0  # always 3 drafts (bar the budget's end): a fixed oracle
    queries = []
    hook = target.model.register_forward_pre_hook(
        lambda m, args, kwargs: queries.append((int(kwargs["cache"].get_seq_length()) if kwargs.get("cache") else 0,
                                                kwargs["input_ids"][0].tolist())), with_kwargs=True)
    dec = build_decoder("hf_assisted", target, drafter)
    rounds = accepted = rolled_back = 0
    try:
        for prompt in PROMPTS:
            queries.clear()
            res = dec.generate(prompt, max_new_tokens=13)
            assert res.tokens == reference(target, prompt, 13)
            text = prompt + res.tokens
            for past, ids in queries:
                committed = len(prompt) if past == 0 else past + 1  # the query starts at the cache's end
                drafts = ids[committed - past:]
                assert drafts == _greedy_without_cache(model, text[:committed], len(drafts)), (prompt, past)
            rounds += len(queries)
            accepted += sum(res.stats.accepted_per_round)
            rolled_back += sum(a < d for a, d in zip(res.stats.accepted_per_round, res.stats.drafted_per_round))
    finally:
        hook.remove()
    assert rounds > len(PROMPTS) and accepted > 0 and rolled_back > 0  # drafts taken, and rejected ones rolled back


def _greedy_without_cache(model, prefix: list[int], n: int) -> list[int]:
    seq = list(prefix)
    with torch.no_grad():
        for _ in range(n):
            seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[len(prefix):]
