"""Speculative sampling follows the target's distribution exactly (chain SpS and tree MSS)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from draftforge.decode import build_decoder, load_drafter, load_target, verify
from draftforge.decode.sampling import SamplingParams, draw_iid, draw_one, probs_from_logits, sample
from draftforge.decode.tree import DraftTree
from tests.fixtures.decode import eagle3_head, feature_mamba_head, noisy_copy, tiny_llama, tiny_mamba

VOCAB = 8
PARAMS = dict(temperature=1.0, top_k=6)


def chi_square_limit(df: int) -> float:
    """Upper tail at roughly p = 1e-4 (Wilson–Hilferty), so a correct sampler passes reliably."""
    z = 3.72
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def chi_square(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """(statistic, degrees of freedom); an outcome the target never emits fails at once (pooled with the rare
    cells, whose expected mass is then 0, it would be dropped and only its shortfall elsewhere seen)."""
    forbidden = [k for k, c in counts.items() if c and not probs.get(k, 0.0) > 0]
    assert not forbidden, f"outcomes of probability 0 under the target: {forbidden[:3]}"
    stat, cells = 0.0, 0
    for key, p in probs.items():
        if p * n >= 5:  # pool rare cells
            stat += (counts.get(key, 0) - n * p) ** 2 / (n * p)
            cells += 1
    rare_p = sum(p for p in probs.values() if p * n < 5)
    rare_c = sum(c for k, c in counts.items() if probs.get(k, 0) * n < 5)
    if rare_p > 0:
        stat += (rare_c - n * rare_p) ** 2 / (n * rare_p)
        cells += 1
    return stat, cells - 1


def exact_two_token(target, prompt) -> dict:
    params = SamplingParams(**PARAMS)
    with torch.no_grad():
        p1 = probs_from_logits(target.model(torch.tensor([prompt])).logits[0, -1], params)
        seqs = torch.tensor([prompt + [a] for a in range(VOCAB)])
        p2 = probs_from_logits(target.model(seqs).logits[:, -1], params)
    return {(a, b): float(p1[a] * p2[a, b]) for a, b in itertools.product(range(VOCAB), repeat=2)}


def assert_two_tokens_follow_target(dec, target, prompt, n=1000):
    """The first two sampled tokens of `dec` over n seeds pass a chi-square test against the exact
    enumerated target distribution, and drafts were really accepted (min(1, p/q) was exercised). Three tokens
    are decoded so that a plan drafts two levels (the engine caps a plan at the tokens left minus one)."""
    counts, accepted = {}, 0
    for seed in range(n):
        res = dec.generate(prompt, max_new_tokens=3, seed=seed, **PARAMS)
        counts[tuple(res.tokens[:2])] = counts.get(tuple(res.tokens[:2]), 0) + 1
        accepted += sum(res.stats.accepted_per_round)
    stat, df = chi_square(counts, exact_two_token(target, prompt), n)
    assert stat < chi_square_limit(df), (stat, df)
    assert accepted > n // 10


@pytest.fixture(scope="module")
def target():
    return load_target(tiny_llama(vocab=VOCAB, hidden=16, layers=1, dtype=torch.float64))


@pytest.mark.slow  # ~20 s each on a shared CPU; the fast verifier-level checks below run by default
@pytest.mark.parametrize("kind,method,options,draws", [
    ("transformer", "chain", {"chain_length": 2}, "distinct"),
    ("mamba", "tree", {"tree": (3, 2)}, "distinct"),
    ("mamba", "tree", {"tree": (3, 2)}, "iid"),
    ("eagle3", "tree", {"tree": (3, 2)}, "distinct"),
    ("feature_mamba2", "chain", {"chain_length": 2}, "distinct"),
])
def test_first_two_tokens_follow_target(target, kind, method, options, draws):
    prompt = [1, 2, 3]
    drafter_model = {"transformer": lambda: noisy_copy(target.model, 0.3), "eagle3": lambda: eagle3_head(target.model, 0.3),
                     "feature_mamba2": lambda: feature_mamba_head(target.model),
                     "mamba": lambda: tiny_mamba(VOCAB, dtype=torch.float64)}[kind]()
    dec = build_decoder(method, target, load_drafter(drafter_model, target), **options)
    n, counts, accepted = 1000, {}, 0
    for seed in range(n):
        res = dec.generate(prompt, max_new_tokens=3, seed=seed, tree_draws=draws, **PARAMS)  # 2 levels drafted
        key = tuple(res.tokens[:2])
        counts[key] = counts.get(key, 0) + 1
        accepted += sum(res.stats.accepted_per_round)
    stat, df = chi_square(counts, exact_two_token(target, prompt), n)
    assert stat < chi_square_limit(df), (stat, df)
    assert accepted > n // 10  # drafts were really accepted, so the test exercised min(1, p/q)


def _verifier_samples(verifier, p_V, q_V, widths, n, seed, distinct=False):
    """Distribution of the first emitted token when children are drawn from q: i.i.d., or `distinct` (without
    replacement, as the drafters draw them for tree_draws="distinct", spare slots repeating the last draw)."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(len(p_V))
    for _ in range(n):
        kids = sample(q_V[None], gen, widths, distinct=distinct)[0].tolist()
        tree = DraftTree(kids, [-1] * widths, [1] * widths, torch.stack([q_V] + [q_V] * widths), widths == 1)
        p_NV = torch.stack([p_V] + [p_V] * widths)
        verdict = verifier(tree, p_NV, gen, distinct=True) if distinct else verifier(tree, p_NV, gen)
        counts[tree.tokens[verdict.path[0]] if verdict.path else verdict.next_token] += 1
    return counts


P_V = torch.tensor([0.5, 0.2, 0.1, 0.1, 0.05, 0.05], dtype=torch.float64)
Q_V = torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3], dtype=torch.float64)


def _check(counts, p_V=P_V):
    probs = {i: float(p) for i, p in enumerate(p_V)}
    return chi_square({i: int(c) for i, c in enumerate(counts)}, probs, int(counts.sum()))


@pytest.mark.parametrize("verifier,widths,distinct", [(verify.verify_chain_sps, 1, False),
                                                      (verify.verify_tree_mss, 3, False),
                                                      (verify.verify_tree_mss, 3, True)])
def test_verifier_exact_and_wrong_residual_fails(monkeypatch, verifier, widths, distinct):
    """The same check rejects a verifier whose rejection distribution is p instead of norm(max(0, p-q))."""
    n = 4000
    stat, df = _check(_verifier_samples(verifier, P_V, Q_V, widths, n, seed=0, distinct=distinct))
    assert stat < chi_square_limit(df)
    monkeypatch.setattr(verify, "residual", lambda p, q: p)
    stat, df = _check(_verifier_samples(verifier, P_V, Q_V, widths, n, seed=0, distinct=distinct))
    assert stat > chi_square_limit(df)


def test_distinct_siblings_need_their_own_rule():
    """Siblings drawn without replacement but verified as if i.i.d. (q left as it is) do not give p: the check
    has the power to tell the two rules apart (enumerated, the wrong rule is 0.07 away from p in total variation
    here; the right one is exact)."""
    p_V = torch.tensor([0.3, 0.3, 0.2, 0.1, 0.05, 0.05], dtype=torch.float64)
    q_V = torch.tensor([0.7, 0.1, 0.1, 0.05, 0.03, 0.02], dtype=torch.float64)
    for rule_matches in (True, False):
        gen = torch.Generator().manual_seed(0)
        counts = torch.zeros(len(p_V))
        for _ in range(4000):
            kids = sample(q_V[None], gen, 3, distinct=True)[0].tolist()
            tree = DraftTree(kids, [-1] * 3, [1] * 3, torch.stack([q_V] * 4), False)
            verdict = verify.verify_tree_mss(tree, torch.stack([p_V] * 4), gen, distinct=rule_matches)
            counts[tree.tokens[verdict.path[0]] if verdict.path else verdict.next_token] += 1
        stat, df = _check(counts, p_V)
        assert (stat < chi_square_limit(df)) == rule_matches, (rule_matches, stat)


def test_distinct_draws_with_fewer_tokens_than_children_stay_exact():
    """q with two tokens of nonzero probability (e.g. after top-k) and three children: the spare slot repeats a
    draw, is skipped by the verifier, and the emitted token still follows p."""
    q_V = torch.tensor([0.0, 0.0, 0.7, 0.0, 0.3, 0.0], dtype=torch.float64)
    gen = torch.Generator().manual_seed(1)
    kids = sample(torch.stack([q_V, Q_V]), gen, 3, distinct=True)
    assert sorted(kids[0].tolist()[:2]) == [2, 4] and kids[0, 2] == kids[0, 1]  # the spare slot repeats
    assert len(set(kids[1].tolist())) == 3  # a full-support row still gets three distinct tokens
    stat, df = _check(_verifier_samples(verify.verify_tree_mss, P_V, q_V, 3, 4000, seed=2, distinct=True))
    assert stat < chi_square_limit(df)


def test_draw_one_follows_unnormalised_weights_and_never_draws_a_zero():
    gen = torch.Generator().manual_seed(3)
    weights = torch.tensor([[0.0, 2.0, 0.0, 1.0, 0.0]]).repeat(30000, 1)
    draws = draw_one(weights, gen)[:, 0]
    assert set(draws.tolist()) == {1, 3}
    assert float((draws == 1).float().mean()) == pytest.approx(2 / 3, abs=0.015)


def _p_some_child_accepted(p_V, q_V, k, distinct):
    """Exact P(one of k siblings is accepted), enumerating every ordered draw (the verifier's rules by hand)."""
    total, vocab = 0.0, len(p_V)
    draws = itertools.permutations(range(vocab), k) if distinct else itertools.product(range(vocab), repeat=k)
    for seq in draws:
        prob, left = 1.0, q_V.clone()
        for x in seq:
            prob *= float(left[x] / left.sum()) if distinct else float(q_V[x])
            left[x] = 0
        if prob == 0:
            continue
        p, q, reach = p_V.clone(), q_V.clone(), 1.0
        for x in seq:
            accept = min(1.0, float(p[x] / q[x]))
            total += prob * reach * accept
            reach *= 1 - accept
            r = (p - q).clamp(min=0)  # the residual norm(max(0, p - q)); p itself when nothing is left
            p = r / r.sum() if r.sum() > 0 else p
            if distinct:
                q = q.clone()
                q[x] = 0
                q = q / q.sum()
    return total


def test_distinct_siblings_never_lower_a_nodes_acceptance():
    """Why distinct is the default: for any p, q, drawing siblings without replacement accepts one of them at
    least as often as i.i.d. draws do (exact enumeration over 5 tokens, 2 and 3 siblings)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(40):
        p_V = (torch.randn(5, dtype=torch.float64, generator=gen) * 2).softmax(0)
        q_V = (torch.randn(5, dtype=torch.float64, generator=gen) * 2).softmax(0)
        for k in (2, 3):
            assert _p_some_child_accepted(p_V, q_V, k, True) >= _p_some_child_accepted(p_V, q_V, k, False) - 1e-12


def test_iid_siblings_are_independent_draws_from_q():
    """tree_draws="iid": three siblings per row, each pair of slots distributed as q x q (enumerated), and a token
    of zero probability never drawn."""
    q_V = torch.tensor([0.5, 0.0, 0.3, 0.2], dtype=torch.float64)
    gen = torch.Generator().manual_seed(5)
    kids = sample(q_V[None].repeat(6000, 1), gen, 3, distinct=False)
    assert kids.shape == (6000, 3) and not bool((kids == 1).any())
    expect = {(a, b): float(q_V[a] * q_V[b]) for a in (0, 2, 3) for b in (0, 2, 3)}
    for first, second in ((0, 1), (1, 2), (0, 2)):
        counts = {}
        for a, b in zip(kids[:, first].tolist(), kids[:, second].tolist()):
            counts[(a, b)] = counts.get((a, b), 0) + 1
        stat, df = chi_square(counts, expect, 6000)
        assert stat < chi_square_limit(df), (first, second, stat)


def test_draw_iid_is_num_draw_one_calls_from_the_same_generator():
    """The i.i.d. draws sum each row's CDF once; they must still be, token for token, what num draw_one calls in a
    row give from an equally seeded generator (rows of uneven mass, zeros, and a row with one nonzero token)."""
    weights = torch.tensor([[0.5, 0.0, 0.3, 0.2], [0.0, 0.0, 2.0, 0.0], [1e-9, 3.0, 0.0, 1.0]])
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        one_by_one = torch.cat([draw_one(weights, gen) for _ in range(5)], -1)
        assert torch.equal(draw_iid(weights, torch.Generator().manual_seed(seed), 5), one_by_one)


def test_top_p_keeps_the_tokens_transformers_keeps_ties_included():
    """Oracle: transformers' TopPLogitsWarper (what generate() samples with). With two tokens tied at the cut a
    descending formulation kept the other one ([0, 0] at top_p 0.5: total variation 1.0); bf16 logits tie often.
    top_p = 0 keeps the one most likely token generate() keeps (the last of a tie)."""
    from transformers import TopPLogitsWarper

    def theirs(logits, top_p, temperature=1.0):
        return TopPLogitsWarper(top_p)(None, logits / temperature).softmax(-1)

    for row, top_p in (([0.0, 0.0], 0.5), ([1.0, 0.5, 0.5, -1.0], 0.6), ([2.0, 2.0, 1.0], 0.0), ([1.0, 3.0], 0.0)):
        logits = torch.tensor([row])
        assert torch.equal(probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=top_p)),
                           theirs(logits, top_p)), (row, top_p)
    gen = torch.Generator().manual_seed(0)
    bf16 = (torch.randn(500, 512, generator=gen) * 3).bfloat16().float()  # many exact ties, as a bf16 model gives
    for top_p, temperature in ((0.9, 0.7), (0.5, 1.0), (0.95, 1.3)):
        ours = probs_from_logits(bf16, SamplingParams(temperature=temperature, top_p=top_p))
        assert torch.equal(ours, theirs(bf16, top_p, temperature))


def test_a_temperature_too_small_to_divide_by_is_its_limit_not_token_0():
    """At T = 1e-39, logits / T overflowed float32, the softmax gave NaN rows and every draw was token 0: chain
    decoded [0, 0, 0, 5, ...] where generate() gives its greedy text. softmax(logits / T) as T -> 0 is an even
    share of the top logits (a point mass without a tie); top_p = 0 keeps the last of a tie, as at any T."""
    logits = torch.tensor([[1.0, 3.0, -2.0, 0.5], [2.0, 2.0, 1.0, -1.0]])
    for t in (1e-39, 1e-45, 1e-21):
        assert torch.equal(probs_from_logits(logits, SamplingParams(temperature=t)),
                           torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.5, 0.5, 0.0, 0.0]]))
        assert torch.equal(probs_from_logits(logits, SamplingParams(temperature=t, top_p=0.0))[1],
                           torch.tensor([0.0, 1.0, 0.0, 0.0]))
    # just above the threshold the division stands and the softmax is already that limit
    assert torch.equal(probs_from_logits(logits, SamplingParams(temperature=1e-19)),
                       probs_from_logits(logits, SamplingParams(temperature=1e-39)))
    target = load_target(tiny_llama(vocab=VOCAB, layers=2, hidden=32, seed=3))
    drafter = load_drafter(noisy_copy(target.model, noise=0.3), target)
    prompt = [5, 1, 2, 7]
    greedy = build_decoder("ar", target).generate(prompt, max_new_tokens=12).tokens
    for method, d in (("ar", None), ("chain", drafter), ("tree", drafter)):
        dec = build_decoder(method, target, d)
        assert dec.generate(prompt, max_new_tokens=12, temperature=1e-39, seed=1).tokens == greedy, method


def test_the_accept_ratio_and_residual_normalise_p_and_q():
    """By hand, first emitted token of a one-draft chain: sum over drafts y of q(y) [a(y) 1{x=y} + (1 - a(y))
    r_y(x)] must be p exactly, with q and p the normalised rows. Rows come as float32 weights whose sums miss 1
    (by ~1e-5 at V = 152k; here by 1e-3 and 2e-3 to make it plain); the ratio and residual were taken on the raw
    rows, off by that much."""
    gen = torch.Generator().manual_seed(3)
    p_w = torch.softmax(torch.randn(6, generator=gen), -1).float() * 1.002
    q_w = torch.softmax(torch.randn(6, generator=gen), -1).float() * 0.999
    p_hat, q_hat = p_w.double() / p_w.double().sum(), q_w.double() / q_w.double().sum()
    out = torch.zeros(6, dtype=torch.float64)
    for y in range(6):
        seen = {}

        class Threshold:  # u < a: record a
            def __lt__(self, a):
                seen["a"] = float(a)
                return False  # follow the rejection branch; its weight is 1 - a

        def draw(probs_V, _gen):
            seen["r"] = probs_V.double() / probs_V.double().sum()
            return 0

        tree = DraftTree([y], [-1], [1], torch.stack([q_w, q_w]), True)
        orig_u, orig_d = verify._uniform, verify._draw
        verify._uniform, verify._draw = (lambda g: Threshold()), draw
        try:
            verify.verify_chain_sps(tree, torch.stack([p_w, p_w]), None)
        finally:
            verify._uniform, verify._draw = orig_u, orig_d
        out[y] += q_hat[y] * seen["a"]
        out += q_hat[y] * (1 - seen["a"]) * seen["r"]
    torch.testing.assert_close(out, p_hat, rtol=0, atol=1e-12)
