"""Lookup first, a trained drafter otherwise: lossless greedy output for every drafter kind with rounds of both kinds
mixed in one decode, exact sampling at T > 0 against the enumerated target, and what bad settings get."""

from __future__ import annotations

import pytest
import torch

from draftforge.decode import build_decoder, load_drafter, load_target
from draftforge.decode.drafters.lookup import PromptLookupDrafter
from draftforge.decode.drafters.lookup_first import LookupFirstDrafter
from draftforge.errors import DraftforgeError, RecipeError
from tests.decode.test_prompt_lookup import S_PARAMS, S_VOCAB, assert_follows_target, looping_prompt
from tests.fixtures.decode import greedy_reference, noisy_copy, tiny_llama

VOCAB = 12
PROMPTS = [[4], [3, 5, 7], [(7 * i + 3) % VOCAB for i in range(23)]]


def lookup_first(drafter, vocab=VOCAB, min_ngram=2):
    return LookupFirstDrafter(PromptLookupDrafter(vocab, min_ngram=min_ngram), drafter)


@pytest.mark.parametrize("kind", ["transformer", "mamba", "mamba2", "eagle3", "feature_mamba2"])
@pytest.mark.parametrize("method,options", [("chain", {"chain_length": 3}), ("tree", {"tree": (3, 2, 1)})],
                         ids=["chain3", "tree321"])
def test_greedy_equals_generate_with_both_drafters_in_one_decode(target, drafters, kind, method, options):
    mixed = lookup_first(drafters[kind])
    dec = build_decoder(method, target, mixed, **options)
    accepted = 0
    for prompt in [*PROMPTS, looping_prompt(target)]:
        for max_new in (1, 13, 24):
            res = dec.generate(prompt, max_new_tokens=max_new)
            assert res.tokens == greedy_reference(target, prompt, max_new), (prompt, max_new)
            assert res.stats.new_tokens == max_new == sum(res.stats.accepted_per_round) + res.stats.target_forwards
            accepted += sum(res.stats.accepted_per_round)
    assert accepted > 0
    # both drafted rounds, so the drafter that sat rounds out caught up with text it had not drafted
    assert mixed.rounds["lookup"] > 0 and mixed.rounds["drafter"] > 0, mixed.rounds


@pytest.mark.parametrize("kind", ["transformer", "mamba", "mamba2", "eagle3"])
def test_the_drafter_drafts_as_if_it_had_read_every_token(target, drafters, kind, monkeypatch):
    """Greedy output stays lossless when the model drafter's state lags (a skipped token only costs acceptance), so
    the oracle is a fresh drafter on a fresh target given the same text from scratch: every round the model drafts
    inside lookup-first, after lookup's rounds it sat out, must draft the same tree."""
    inner, rounds = drafters[kind], []
    draft = inner.draft

    def recorded(seq, plan, params, generator):
        tree = draft(seq, plan, params, generator)
        rounds.append((list(seq), plan, params, tree.tokens))
        return tree

    monkeypatch.setattr(inner, "draft", recorded)
    mixed = lookup_first(inner)
    dec = build_decoder("tree", target, mixed, tree=(3, 2, 1))
    for prompt in [*PROMPTS, looping_prompt(target)]:
        dec.generate(prompt, max_new_tokens=24)
    assert mixed.rounds["lookup"] > 0 and len(rounds) > 4
    for seq, plan, params, tokens in rounds:
        fresh_target = load_target(target.model)
        fresh = load_drafter(inner.model, fresh_target)
        fresh_target.prefill(seq)
        assert fresh.draft(seq, plan, params, torch.Generator().manual_seed(0)).tokens == tokens, (kind, len(seq))


def test_only_the_drafter_that_drafted_hears_what_was_accepted(target, drafters):
    class Spy(PromptLookupDrafter):
        told = 0

        def accept_levels(self, path):
            Spy.told += 1

    mixed = LookupFirstDrafter(Spy(VOCAB, min_ngram=2), drafters["transformer"])
    build_decoder("chain", target, mixed, chain_length=3).generate(looping_prompt(target), max_new_tokens=20)
    assert Spy.told == mixed.rounds["lookup"] > 0


def test_drafter_depth_caps_only_the_drafters_rounds(target, drafters, monkeypatch):
    inner, sizes = drafters["mamba2"], []
    draft = inner.draft

    def recorded(*args, **kwargs):
        tree = draft(*args, **kwargs)
        sizes.append(len(tree))
        return tree

    monkeypatch.setattr(inner, "draft", recorded)
    mixed = LookupFirstDrafter(PromptLookupDrafter(VOCAB, min_ngram=2), inner, drafter_depth=1)
    dec = build_decoder("chain", target, mixed, chain_length=4)
    longest = 0
    for prompt in [*PROMPTS, looping_prompt(target)]:
        res = dec.generate(prompt, max_new_tokens=24)
        assert res.tokens == greedy_reference(target, prompt, 24)
        longest = max(longest, *res.stats.drafted_per_round)
    assert sizes and max(sizes) == 1  # the drafter's rounds: one draft at most
    assert longest == 4  # lookup's rounds still draft the plan's whole chain
    with pytest.raises(DraftforgeError, match="drafter depth must be an integer >= 1"):
        LookupFirstDrafter(PromptLookupDrafter(VOCAB), inner, drafter_depth=0)
    spec = load_drafter(drafters["transformer"].model, target, lookup_first="prompt-lookup:drafter_tokens=2")
    assert spec.drafter_depth == 2 and spec.lookup.index.min_ngram == 2
    with pytest.raises(RecipeError, match="unknown or malformed option 'drafter_tokens=2'"):
        load_drafter("prompt-lookup:drafter_tokens=2", target)  # only a lookup_first spec takes it


@pytest.fixture(scope="module")
def small_target():
    return load_target(tiny_llama(vocab=S_VOCAB, hidden=16, layers=1, dtype=torch.float64))


def test_sampling_follows_the_target_across_lookup_and_drafter_rounds(small_target):
    """Three tokens after [1, 2, 3, 1, 2]: lookup drafts (3, 1) in the first round (the bigram 1, 2 occurred); later
    rounds draft with lookup or the noisy-copy drafter depending on the tokens sampled, and the output must still be
    distributed exactly as the target's own sampling."""
    drafter = load_drafter(noisy_copy(small_target.model, noise=0.3), small_target)
    mixed = lookup_first(drafter, vocab=S_VOCAB)
    dec = build_decoder("chain", small_target, mixed, chain_length=2)
    assert_follows_target(dec, small_target, [1, 2, 3, 1, 2], 3, 3000)
    assert mixed.rounds["lookup"] > 300 and mixed.rounds["drafter"] > 300, mixed.rounds


def test_load_drafter_wraps_and_bad_settings_are_refused(target, drafters):
    model = drafters["transformer"].model
    wrapped = load_drafter(model, target, lookup_first="prompt-lookup")
    assert isinstance(wrapped, LookupFirstDrafter) and wrapped.lookup.index.min_ngram == 2  # the default here
    assert wrapped.target is target and wrapped.lookup.target is target
    assert load_drafter(model, target, lookup_first="prompt-lookup:min_ngram=3").lookup.index.min_ngram == 3
    with pytest.raises(RecipeError, match="not a prompt-lookup spec"):
        load_drafter(model, target, lookup_first="runs/some/export")
    with pytest.raises(DraftforgeError, match="needs a trained drafter"):
        load_drafter("prompt-lookup", target, lookup_first="prompt-lookup")
    with pytest.raises(DraftforgeError, match="method eagle2 ranks the drafter's next-token probabilities"):
        build_decoder("eagle2", target, lookup_first(drafters["eagle3"]))  # when built, not at the first round


def test_eval_refuses_lookup_first_without_a_trained_drafter_or_with_dynamic_trees():
    from draftforge.eval.config import EvalConfig, validate

    base = dict(target="t", bench="testbed", drafter="runs/x/export", lookup_first="prompt-lookup")
    with pytest.raises(RecipeError, match="eagle2 build dynamic trees"):
        validate(EvalConfig(**base, methods=("ar", "chain", "eagle2")))
    with pytest.raises(RecipeError, match="falls back on a trained drafter"):
        validate(EvalConfig(**{**base, "drafter": "prompt-lookup"}, methods=("ar", "chain")))
    with pytest.raises(RecipeError, match="not a prompt-lookup spec"):
        validate(EvalConfig(**{**base, "lookup_first": "yes"}, methods=("ar", "chain")))
    assert validate(EvalConfig(**base, methods=("ar", "chain", "tree"))).lookup_first == "prompt-lookup"
