"""Speculative sampling, exactly. Every random choice the decoder makes (each draw of a drafter's tokens, of a
correction or of a bonus token, and each acceptance test's uniform) becomes a branch with its probability; the
real decoder (the engine, the drafters, the verifiers, tiny float64 models) is replayed down every branch, and the
branch weights summed per output give the exact distribution of its first M tokens. It must equal the target's
own (its warped distribution, enumerated from plain forwards) to float64 rounding: there is no sampling noise to
allow for, so a verifier off by a hundredth of a percent fails here where a chi-square over 1,000 seeds
(test_sampling.py) cannot see it. M = 3 lets a plan draft two levels deep (the engine caps a plan at the tokens
left minus one)."""

from __future__ import annotations

import math

import pytest
import torch

from draftforge.decode import build_decoder, load_drafter, load_target, sampling, verify
from draftforge.decode.sampling import SamplingParams, probs_from_logits
from tests.fixtures.decode import eagle3_head, feature_mamba_head, noisy_copy, tiny_llama, tiny_mamba

VOCAB, M = 8, 3
PROMPT = [1, 2, 1, 3, 1, 2]  # repeats, so prompt lookup proposes too
TOLERANCE = 1e-12  # total variation: float64 rounding over a few hundred branches, nothing else


class _Branch(Exception):
    """A choice past the replayed prefix: its options, (value, probability) each."""


class Replay:
    """Makes the choices of one branch (a prefix of (value, probability) pairs) and raises _Branch at the first
    choice past it."""

    def __init__(self, prefix: list):
        self.prefix, self.pos = prefix, 0

    def choose(self, options: list):
        if self.pos < len(self.prefix):
            self.pos += 1
            return self.prefix[self.pos - 1][0]
        raise _Branch(options)


class _Uniform:
    """The verifier's u: `u < a` holds with probability a, a branch of the replay."""

    def __init__(self, replay: Replay):
        self.replay = replay

    def __lt__(self, a) -> bool:
        a = min(max(float(a), 0.0), 1.0)
        return self.replay.choose([(True, a), (False, 1.0 - a)])


def exact_decoder_distribution(dec, params: SamplingParams, monkeypatch, prompt=PROMPT) -> tuple[dict, dict]:
    """{first M tokens: probability} of `dec` at `params`, and what the replays saw: `runs` (branches),
    `deepest` (the most tokens one round drafted) and `accepted` (the expected drafts the first round accepts,
    exactly: a test where no draft is ever accepted checks nothing of the acceptance rule). Every draw goes
    through sampling.draw_iid (draws of drafts, distinct or not, and of corrections and bonus tokens) and every
    acceptance test through verify._uniform: those two are the decoder's randomness, replaced by branches."""
    state = {}

    def draw_iid(weights_NV, generator, num):
        rows = []
        for w in weights_NV.to(torch.float64).cpu():
            w = w / w.sum()
            rows.append([state["replay"].choose([(t, float(w[t])) for t in range(len(w)) if w[t] > 0])
                         for _ in range(num)])
        return torch.tensor(rows, device=weights_NV.device)

    monkeypatch.setattr(sampling, "draw_iid", draw_iid)
    monkeypatch.setattr(verify, "_uniform", lambda generator: _Uniform(state["replay"]))
    out, stack, seen = {}, [[]], {"runs": 0, "deepest": 0, "accepted": 0.0}
    while stack:
        prefix = stack.pop()
        state["replay"] = Replay(prefix)
        dec.reset()  # a stop rule's own generator starts again: the branch replays the same calls
        try:
            res = dec.generate(prompt, max_new_tokens=M, params=params, seed=0, eos_token_id=[])
        except _Branch as branch:
            stack += [prefix + [option] for option in branch.args[0] if option[1] > 0]
            continue
        weight, key = math.prod(p for _, p in prefix), tuple(res.tokens)
        out[key] = out.get(key, 0.0) + weight
        seen["runs"] += 1
        seen["deepest"] = max(seen["deepest"], *res.stats.drafted_per_round)
        seen["accepted"] += weight * res.stats.accepted_per_round[0]
    return out, seen


def target_distribution(model, params: SamplingParams, prompt=PROMPT) -> dict:
    """{first M tokens: probability} of sampling the target itself, one forward per prefix."""
    probs = {(): 1.0}
    for _ in range(M):
        keys = list(probs)
        with torch.no_grad():
            p_KV = probs_from_logits(model(torch.tensor([prompt + list(k) for k in keys])).logits[:, -1], params)
        probs = {k + (t,): probs[k] * float(p_KV[i, t]) for i, k in enumerate(keys) for t in range(VOCAB)
                 if p_KV[i, t] > 0}
    return probs


def total_variation(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


@pytest.fixture(scope="module")
def target():
    return load_target(tiny_llama(vocab=VOCAB, hidden=16, layers=1, dtype=torch.float64))


DRAFTERS = {
    "transformer": lambda t: noisy_copy(t.model, 0.3),
    "mamba": lambda t: tiny_mamba(VOCAB, dtype=torch.float64),
    "eagle3": lambda t: eagle3_head(t.model, 0.3),
    "eagle3-reduced": lambda t: eagle3_head(t.model, 0.3, draft_vocab=[0, 2, 3, 5, 6]),  # q = 0 on 1, 4, 7
    "feature_mamba2": lambda t: feature_mamba_head(t.model),
    "lookup": lambda t: "prompt-lookup",
}


MAMBA_PROMPT = [5, 7, 3]  # the random Mamba2 drafter's top 2 overlaps the target's here (on most prompts it does not)


@pytest.mark.parametrize("kind,method,options,draws,warp,prompt", [  # warp: (temperature, top_p, top_k), few branches
    ("transformer", "chain", {"chain_length": 2}, "iid", (0.9, 0.9, 3), PROMPT),
    ("mamba", "tree", {"tree": (2, 2)}, "distinct", (1.3, 1.0, 2), MAMBA_PROMPT),
    ("mamba", "tree", {"tree": (2, 1)}, "iid", (0.7, 1.0, 2), MAMBA_PROMPT),
    ("eagle3", "tree", {"tree": (3, 1)}, "distinct", (0.9, 1.0, 2), PROMPT),  # a spare sibling slot
    ("eagle3-reduced", "tree", {"tree": (2, 2)}, "distinct", (1.0, 1.0, 2), PROMPT),
    ("feature_mamba2", "chain", {"chain_length": 2}, "iid", (0.9, 1.0, 3), PROMPT),
    ("lookup", "tree", {"tree": (2, 1)}, "distinct", (0.9, 1.0, 3), PROMPT),
    ("transformer", "beta_ts", {"max_draft": 2}, "iid", (0.9, 0.9, 3), PROMPT),
    # lookup first, a reduced head reading the target where lookup finds nothing: rounds of both kinds in a decode
    ("lookup-first:eagle3-reduced", "chain", {"chain_length": 2}, "iid", (1.0, 1.0, 3), PROMPT),
], ids=lambda v: v if isinstance(v, str) else "")
def test_the_decoders_exact_distribution_is_the_targets(target, monkeypatch, kind, method, options, draws, warp,
                                                        prompt):
    temperature, top_p, top_k = warp
    params = SamplingParams(temperature, top_p, top_k, draws)
    first, _, kind = kind.rpartition(":")
    lookup_first = "prompt-lookup:min_ngram=2" if first else None
    drafter = load_drafter(DRAFTERS[kind](target), target, lookup_first=lookup_first)
    dec = build_decoder(method, target, drafter, **options)
    got, seen = exact_decoder_distribution(dec, params, monkeypatch, prompt)
    assert abs(sum(got.values()) - 1.0) < TOLERANCE
    assert seen["deepest"] >= 2, "the plan must reach past depth 1 (a two-token decode never does)"
    assert seen["accepted"] > 0.2, seen  # the acceptance rule was exercised, not only the residual
    assert total_variation(got, target_distribution(target.model, params, prompt)) < TOLERANCE
    if lookup_first:  # both kinds of round were enumerated
        assert drafter.rounds["lookup"] > 0 and drafter.rounds["drafter"] > 0, drafter.rounds


def test_the_exact_check_sees_a_verifier_that_tests_every_level_against_the_roots_q(target, monkeypatch):
    """The mutant a two-token chi-square passed (it never drafts past depth 1): children below the root tested
    against the root's q row."""
    from draftforge.decode.tree import DraftTree

    real = verify.verify_tree_mss

    def wrong_rows(tree, p_NV, generator, distinct=False):
        rows = tree.q_probs[:1].expand_as(tree.q_probs)
        return real(DraftTree(tree.tokens, tree.parents, tree.depths, rows, tree.is_chain, tree.fixed_drafts),
                    p_NV, generator, distinct)

    monkeypatch.setattr(verify, "verify_tree_mss", wrong_rows)
    params = SamplingParams(1.0, 1.0, 2, "distinct")
    dec = build_decoder("tree", target, load_drafter(DRAFTERS["mamba"](target), target), tree=(3, 2))
    got, _ = exact_decoder_distribution(dec, params, monkeypatch, prompt=[1, 2, 3])
    assert total_variation(got, target_distribution(target.model, params, prompt=[1, 2, 3])) > 1e-3
