"""Prompt lookup (n-gram) drafting: the matcher by hand, lossless greedy output on KV, SSM and hybrid
targets, exact sampling at T > 0 (chain and fixed siblings), transformers' own prompt lookup, specs."""

from __future__ import annotations

import pytest
import torch

from draftforge.decode import build_decoder, load_drafter, load_target, parse_tree, verify
from draftforge.decode.drafters.lookup import NgramIndex, PromptLookupDrafter
from draftforge.decode.loading import lookup_options
from draftforge.decode.methods import METHODS
from draftforge.decode.sampling import SamplingParams, probs_from_logits
from draftforge.decode.tree import DraftTree
from draftforge.errors import DraftforgeError, RecipeError
from tests.decode.test_sampling import chi_square, chi_square_limit
from tests.fixtures.decode import greedy_reference, tiny_llama
from tests.fixtures.hybrid import tiny_bamba, tiny_mamba2_target

VOCAB = 12
GREEDY = SamplingParams()


def draft(seq, plan, max_ngram=3, **kw):
    drafter = PromptLookupDrafter(VOCAB, max_ngram=max_ngram, **kw)
    return drafter.draft(list(seq), plan, GREEDY, None)


# ---------------------------------------------------------------- the matcher, by hand

def test_longest_suffix_ngram_wins_over_a_more_recent_shorter_match():
    # (1, 2, 3) recurs at the start (then 4); the last 3 alone recurs later (then 5)
    tree = draft([1, 2, 3, 4, 8, 3, 5, 1, 2, 3], (1,) * 4)
    assert tree.tokens == [4, 8, 3, 5] and tree.parents == [-1, 0, 1, 2] and tree.is_chain


def test_most_recent_match_and_its_period_past_the_end():
    # 7 is followed by 1, then 3: the most recent (3, 4, 7) runs into the end and repeats with period 3
    tree = draft([7, 1, 2, 7, 3, 4, 7], (1,) * 5, max_ngram=1)
    assert tree.tokens == [3, 4, 7, 3, 4]
    assert draft([5, 6, 5, 6, 5], (1,) * 4).tokens == [6, 5, 6, 5]  # (5, 6, 5) at 0: a loop keeps looping


def test_siblings_are_distinct_continuations_longest_then_most_recent():
    # (9, 2, 9) recurs once (then 3); the 1-gram 9 was followed by 2 (most recent), 3, 2, 1
    seq = [9, 1, 9, 2, 9, 3, 9, 2, 9]
    tree = draft(seq, (3, 1))
    assert tree.tokens == [3, 2, 1, 9, 9, 9] and tree.parents == [-1, -1, -1, 0, 1, 2] and not tree.is_chain
    assert draft(seq, (2, 1)).tokens == [3, 2, 9, 9]  # fewer slots: the best continuations keep them
    assert draft(seq, (1, 1)).tokens == [3, 9]  # a chain: the best match only


def test_matches_sharing_a_first_token_branch_deeper():
    tree = draft([4, 5, 6, 4, 5, 7, 4], (2, 2, 1), max_ngram=1)  # 4 -> (5, 7, 4) recent, (5, 6, 4) older
    assert tree.tokens == [5, 7, 6, 4, 4] and tree.parents == [-1, 0, 0, 1, 2] and tree.depths == [1, 2, 2, 3, 3]


def test_tree_shapes_stay_inside_the_plan():
    seq = [9, 1, 9, 2, 9, 3, 9, 2, 9]
    stree = parse_tree("stree13")  # nodes at one depth have 2, 1 or 0 children
    tree = draft(seq, stree)
    assert tree.tokens[:2] == [3, 2] and tree.depths[:2] == [1, 1] and len(tree) <= stree.size
    for j, parent in enumerate(tree.parents):  # a valid breadth-first tree
        assert parent < j and (parent == -1 or tree.depths[parent] == tree.depths[j] - 1)


def test_no_match_drafts_nothing_and_the_proposal_length_caps_the_depth():
    assert len(draft([1, 2, 3, 4], (1,) * 5)) == 0 and len(draft([1, 2, 3, 4], (3, 2, 1))) == 0
    assert draft([1, 2, 3, 1, 2], (1,) * 5, max_tokens=2).tokens == [3, 1]
    assert len(draft([5, 1, 5], (1,) * 5, max_ngram=2, min_ngram=2)) == 0  # only the 1-gram 5 recurs


def test_index_follows_a_growing_text_and_restarts_on_another_one():
    index = NgramIndex(2)
    seq = [1, 2, 1]
    index.sync(seq)
    assert list(index.matches()) == [(1, 1)]
    seq += [2]  # the engine grows its list in place
    index.sync(seq)
    assert list(index.matches()) == [(2, 2), (1, 2)]  # (1, 2) at 0..1, then the 1-gram 2 at 1
    index.sync([3, 3])
    assert index.tokens == [3, 3] and list(index.matches()) == [(1, 1)]


def test_sampling_drafts_are_fixed_point_masses():
    drafter = PromptLookupDrafter(VOCAB)
    tree = drafter.draft([9, 1, 9, 2, 9, 3, 9, 2, 9], (3, 1), SamplingParams(temperature=1.0), None)
    assert tree.fixed_drafts and tree.tokens == [3, 2, 1, 9, 9, 9]
    first_child = {-1: 3, 0: 9, 1: 9, 2: 9}
    for row, tok in first_child.items():
        assert tree.q_probs[1 + row].tolist() == [float(t == tok) for t in range(VOCAB)]
    assert not tree.q_probs[4:].any()  # leaves


# ---------------------------------------------------------------- lossless greedy decoding

def looping_prompt(target, base=(3, 5, 7), n=24):
    """The target's own greedy text: tiny random models fall into loops, so its n-grams recur."""
    return list(base) + greedy_reference(target, list(base), n)


def fresh_prompt(target, new):
    """A 2-token prompt whose text stays free of repeated tokens while the target adds `new` - 1 tokens: no
    n-gram ever matches, so every round is plain decoding."""
    for a in range(VOCAB):
        for b in range(VOCAB):
            text = [a, b] + greedy_reference(target, [a, b], new - 1)
            if len(set(text)) == len(text):
                return [a, b]
    pytest.skip("no repeat-free text on this target")


SHAPES = [("chain", {"chain_length": 4}), ("tree", {"tree": (3, 2, 1)}), ("tree", {"tree": parse_tree("stree13")}),
          ("ucb", {"ucb_trees": [(1, 1), (3, 2, 1)]})]


@pytest.mark.parametrize("method,options", SHAPES, ids=["chain4", "tree321", "stree13", "ucb"])
def test_greedy_equals_generate_and_drafts_are_accepted(target, method, options):
    dec = build_decoder(method, target, load_drafter("prompt-lookup", target), **options)
    accepted = 0
    for prompt in (looping_prompt(target), [1, 2, 3, 4, 5, 1, 2, 3]):
        for max_new in (1, 13):
            res = dec.generate(prompt, max_new_tokens=max_new)
            assert res.tokens == greedy_reference(target, prompt, max_new), (prompt, max_new)
            assert res.stats.new_tokens == max_new == sum(res.stats.accepted_per_round) + res.stats.target_forwards
            accepted += sum(res.stats.accepted_per_round)
    assert accepted > 5


@pytest.mark.parametrize("method,options", SHAPES[:2], ids=["chain4", "tree321"])
def test_without_repeats_every_round_is_plain_decoding(target, method, options):
    new = 3
    prompt = fresh_prompt(target, new)
    res = build_decoder(method, target, load_drafter("prompt-lookup", target), **options).generate(
        prompt, max_new_tokens=new)
    assert res.tokens == greedy_reference(target, prompt, new)
    assert res.stats.drafted_per_round == [0] * new and res.stats.target_forwards == new


def test_a_length_controlled_chain_is_lossless(target):
    """beta_ts ends chains early; the lookup drafter gives its stop rule q = 1 for each draft."""
    dec = build_decoder("beta_ts", target, load_drafter("prompt-lookup:ngram=2", target))
    prompt = looping_prompt(target)
    res = dec.generate(prompt, max_new_tokens=13)
    assert res.tokens == greedy_reference(target, prompt, 13)


@pytest.mark.parametrize("make", [tiny_bamba, tiny_mamba2_target], ids=["bamba", "mamba2"])
def test_hybrid_and_ssm_targets_greedy_equals_generate(make):
    target = load_target(make(vocab=48))
    drafter = load_drafter("prompt-lookup", target)
    prompt = looping_prompt(target, base=(4, 9, 2), n=20)
    accepted = 0
    for method, options in SHAPES[:2]:
        res = build_decoder(method, target, drafter, **options).generate(prompt, max_new_tokens=12)
        assert res.tokens == greedy_reference(target, prompt, 12), method
        accepted += sum(res.stats.accepted_per_round)
    assert accepted > 0


# ---------------------------------------------------------------- exact sampling at T > 0

P_V = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05], dtype=torch.float64)


def first_token_counts(tree, n, seed, distinct):
    gen, counts = torch.Generator().manual_seed(seed), torch.zeros(len(P_V))
    p_NV = torch.stack([P_V] * (1 + len(tree)))
    for _ in range(n):
        verdict = verify.verify_tree_mss(tree, p_NV, gen, distinct=distinct)
        counts[tree.tokens[verdict.path[0]] if verdict.path else verdict.next_token] += 1
    return counts


@pytest.mark.parametrize("distinct", [True, False], ids=["distinct", "iid"])
def test_fixed_siblings_are_exact_and_a_drawn_q_would_not_be(distinct):
    """Fixed siblings (a low-p token first) follow p with either tree_draws rule; the same tokens verified as if
    drawn from a q spread over them (uniform) do not: the check can tell."""
    kids = [4, 0, 2]
    fixed = DraftTree(kids, [-1] * 3, [1] * 3, None, fixed_drafts=True)
    counts = first_token_counts(fixed, 4000, 0, distinct)
    stat, df = chi_square({i: int(c) for i, c in enumerate(counts)}, dict(enumerate(P_V.tolist())), 4000)
    assert stat < chi_square_limit(df)
    uniform_V = torch.zeros(len(P_V), dtype=torch.float64)
    uniform_V[kids] = 1 / 3
    drawn = DraftTree(kids, [-1] * 3, [1] * 3, torch.stack([uniform_V] * 4))
    counts = first_token_counts(drawn, 4000, 0, distinct)
    stat, df = chi_square({i: int(c) for i, c in enumerate(counts)}, dict(enumerate(P_V.tolist())), 4000)
    assert stat > chi_square_limit(df)


S_VOCAB, S_PARAMS = 8, dict(temperature=1.0, top_k=6)


@pytest.fixture(scope="module")
def small_target():
    return load_target(tiny_llama(vocab=S_VOCAB, hidden=16, layers=1, dtype=torch.float64))


def exact_sequences(model, prompt, length) -> dict:
    """P(first `length` sampled tokens) under the target, enumerated prefix by prefix."""
    params, probs = SamplingParams(**S_PARAMS), {(): 1.0}
    for _ in range(length):
        keys = list(probs)
        with torch.no_grad():
            p_KV = probs_from_logits(model(torch.tensor([prompt + list(k) for k in keys])).logits[:, -1], params)
        probs = {k + (t,): probs[k] * float(p_KV[i, t]) for i, k in enumerate(keys) for t in range(S_VOCAB)}
    return probs


def assert_follows_target(dec, target, prompt, length, n, draws="distinct") -> tuple[int, dict]:
    """Chi-square of the first `length` tokens over n seeds against the enumerated target; (accepted, exact)."""
    counts, accepted = {}, 0
    for seed in range(n):
        res = dec.generate(prompt, max_new_tokens=length, seed=seed, tree_draws=draws, **S_PARAMS)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
        accepted += sum(res.stats.accepted_per_round)
    exact = exact_sequences(target.model, prompt, length)
    stat, df = chi_square(counts, exact, n)
    assert stat < chi_square_limit(df), (stat, df)
    assert accepted > n // 10  # drafts were really tested against p
    return accepted, exact


def test_chain_sampling_follows_the_target(small_target):
    """Three tokens: the first round drafts two (x, then 2) from the earlier 1 -> x -> 2, with x the target's
    likeliest next token, so depth-2 acceptance, rejection residuals and the bonus all occur."""
    with torch.no_grad():
        p_xV = torch.stack([probs_from_logits(small_target.model(torch.tensor([[1, x, 2, 1]])).logits[0, -1],
                                              SamplingParams(**S_PARAMS)) for x in range(S_VOCAB)])
    x = int(p_xV.diagonal().argmax())
    dec = build_decoder("chain", small_target, load_drafter("prompt-lookup", small_target), chain_length=2)
    assert_follows_target(dec, small_target, [1, x, 2, 1], 3, 3000)


@pytest.mark.parametrize("draws", ["distinct", "iid"])
def test_tree_sampling_with_fixed_siblings_follows_the_target(small_target, draws):
    """Three depth-1 siblings (5, 3, 2: what followed 1, most recent first) verified by the fixed-drafts rule: one
    is accepted exactly when the first token is one of them, p(5) + p(3) + p(2) of the time, not only p(5)."""
    dec = build_decoder("tree", small_target, load_drafter("prompt-lookup", small_target), tree=(3, 1))
    n = 2000
    accepted, exact = assert_follows_target(dec, small_target, [1, 2, 1, 3, 1, 5, 1], 2, n, draws)
    p_first = {t: sum(p for seq, p in exact.items() if seq[0] == t) for t in (5, 3, 2)}
    p_any = sum(p_first.values())
    assert abs(accepted / n - p_any) < 4 * (p_any * (1 - p_any) / n) ** 0.5
    assert p_any - p_first[5] > 0.2  # so later siblings were accepted too


# ---------------------------------------------------------------- transformers' prompt lookup, specs

def test_hf_prompt_lookup_greedy_equals_generate(target):
    assert not METHODS["hf_prompt_lookup"].baseline and not METHODS["hf_prompt_lookup"].needs_drafter
    dec = build_decoder("hf_prompt_lookup", target, lookup_tokens=4)
    accepted = 0
    for prompt in (looping_prompt(target), [1, 2, 3, 4]):
        res = dec.generate(prompt, max_new_tokens=11)
        assert res.tokens == greedy_reference(target, prompt, 11) == build_decoder("ar", target).generate(
            prompt, max_new_tokens=11).tokens
        assert res.stats.new_tokens == 11 == sum(res.stats.accepted_per_round) + res.stats.target_forwards
        assert max(res.stats.drafted_per_round) <= 4
        accepted += sum(res.stats.accepted_per_round)
    assert accepted > 0


def test_hf_prompt_lookup_refuses_recurrent_targets_and_bad_options(target):
    with pytest.raises(DraftforgeError, match="KV cache"):
        build_decoder("hf_prompt_lookup", load_target(tiny_bamba(vocab=48)))
    with pytest.raises(RecipeError, match="--lookup-tokens"):
        build_decoder("hf_prompt_lookup", target, lookup_tokens=0)


def test_specs_give_the_options_and_bad_specs_say_what_to_write(target):
    drafter = load_drafter("prompt-lookup:ngram=2,tokens=4", target)
    assert drafter.kind == "lookup" and drafter.index.max_ngram == 2 and drafter.max_tokens == 4
    assert lookup_options("prompt_lookup") == {"max_ngram": 3} and lookup_options("some/checkpoint") is None
    assert lookup_options("prompt-lookup:min_ngram=2") == {"min_ngram": 2, "max_ngram": 3}
    bad = {"prompt-lookup:ngram=0": ">= 1", "prompt-lookup:tokens=x": ">= 1", "prompt-lookup:size=3": "unknown",
           "prompt-lookup:ngram": "malformed", "prompt-lookup:ngram=2,ngram=3": "repeats",
           "prompt-lookup:min_ngram=4": "above ngram"}
    for spec, words in bad.items():
        with pytest.raises(RecipeError, match=words):
            load_drafter(spec, target)


def test_dynamic_trees_are_refused_with_a_reason(target):
    """Refused when the decoder is built (it was at the first round, and not at all with max_new_tokens <= 1)."""
    with pytest.raises(DraftforgeError, match="method eagle2 ranks .* the lookup drafter has none .* use chain, tree "
                                              "or ucb"):
        build_decoder("eagle2", target, load_drafter("prompt-lookup", target))
    with pytest.raises(DraftforgeError, match="method c2t ranks .* the lookup drafter has none"):
        build_decoder("c2t", target, load_drafter("prompt-lookup", target), c2t="no-head-needed-to-refuse")


# ---------------------------------------------------------------- the `lookup` method: lookup in any run

def test_the_lookup_method_is_the_lookup_chain_whatever_drafter_the_run_loaded():
    """`lookup` decodes exactly as chain over a prompt-lookup drafter (tokens and rounds, T = 0 and T = 1 with the
    same seed), with no drafter or with an EAGLE-3 head bound to the same target (which makes the target keep
    feature rows the lookup never takes); the head, run between the lookup's runs, still decodes the target's
    greedy text."""
    from tests.fixtures.decode import eagle3_head

    assert not METHODS["lookup"].needs_drafter and not METHODS["lookup"].baseline
    target = load_target(tiny_llama(vocab=VOCAB, dtype=torch.float64))  # its own: a head binds to it
    head = load_drafter(eagle3_head(target.model), target)
    reference = build_decoder("chain", target, load_drafter("prompt-lookup", target), chain_length=4)
    runs = {"none": build_decoder("lookup", target, lookup_chain_length=4),
            "head": build_decoder("lookup", target, head, lookup_chain_length=4)}
    head_chain = build_decoder("chain", target, head, chain_length=3)
    accepted = 0
    for prompt in (looping_prompt(target), [1, 2, 3, 4, 5, 1, 2, 3]):
        for temperature in (0.0, 1.0):
            want = reference.generate(prompt, max_new_tokens=13, seed=3, temperature=temperature)
            for name, dec in runs.items():
                got = dec.generate(prompt, max_new_tokens=13, seed=3, temperature=temperature)
                assert got.tokens == want.tokens, (name, temperature)
                assert got.stats.drafted_per_round == want.stats.drafted_per_round, name
                assert got.stats.accepted_per_round == want.stats.accepted_per_round, name
                assert head_chain.generate(prompt, max_new_tokens=13).tokens == greedy_reference(target, prompt, 13)
            accepted += sum(want.stats.accepted_per_round)
    assert accepted > 5
    assert max(runs["none"].generate(looping_prompt(target), max_new_tokens=13).stats.drafted_per_round) == 4


def test_the_lookup_method_refuses_bad_options(target):
    with pytest.raises(RecipeError, match="--lookup-chain-length"):
        build_decoder("lookup", target, lookup_chain_length=0)
    with pytest.raises(RecipeError, match="--lookup-spec must be a prompt-lookup spec"):
        build_decoder("lookup", target, lookup_spec="some/checkpoint")
    with pytest.raises(RecipeError, match="unknown"):
        build_decoder("lookup", target, lookup_spec="prompt-lookup:size=3")
    dec = build_decoder("lookup", target, lookup_spec="prompt-lookup:ngram=1,tokens=2")
    assert dec.drafter.index.max_ngram == 1 and dec.drafter.max_tokens == 2
