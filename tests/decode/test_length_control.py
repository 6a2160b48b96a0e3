"""Draft-length controllers (Beta-TS, Cali-TS, SpecDec++): hand-computed posteriors, seeded draws, per-prompt
restarts, the drafters' hidden states, lossless greedy with every drafter kind, and bad options."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from draftforge.decode import DraftTree, StoppableChain, StopRule, build_decoder, load_drafter, load_target
from draftforge.decode.control import Round
from draftforge.decode.methods.length_control import (
    BetaPosterior,
    BetaTS,
    CaliTS,
    GaussianCalibration,
    SpecDecPP,
)
from draftforge.decode.plan import DraftStep
from draftforge.decode.sampling import SamplingParams
from draftforge.errors import CheckpointError, CompatibilityError, DraftforgeError, RecipeError
from draftforge.models.cali_ts import (
    ThetaPredictor,
    hidden_size,
    model_fingerprint,
    save_predictor,
)
from tests.decode.test_plans import Recompute
from tests.fixtures.decode import greedy_reference, greedy_runs, noisy_copy, three_drafters, tiny_llama, tiny_mamba2

VOCAB = 12
PROMPTS = [[4], [3, 5, 7], [(7 * i + 3) % VOCAB for i in range(23)]]
SCRIPT = [(2, 5), (5, 5), (0, 3), (1, 4)]  # (accepted a, drafted k) per verified round


def chain_round(a: int, k: int) -> Round:
    tree = DraftTree(list(range(k)), list(range(-1, k - 1)), list(range(1, k + 1)), is_chain=True)
    return Round(None, tree, list(range(a)), a + 1, 0.0, 0.0)


# ---------------------------------------------------------------- posteriors, by hand

def test_beta_posterior_resolved_update_by_hand():
    """α += a, β += 1[a<k] (docs/methods/cali-ts.md §2): α = 1+2+5+0+1 = 9, β = 1+1+0+1+1 = 4."""
    ctl = BetaTS()
    for a, k in SCRIPT:
        ctl.feedback(chain_round(a, k))
    assert (ctl.posterior.alpha, ctl.posterior.beta) == (9.0, 4.0)
    ctl.feedback(chain_round(0, 0))  # a round without drafts teaches nothing
    assert (ctl.posterior.alpha, ctl.posterior.beta) == (9.0, 4.0)


def test_beta_posterior_literal_update_by_hand():
    """Eqs. (3)-(4) read literally (|Q_v| = a+1): β += min(2, k-a): 1+2+0+2+2 = 7; α as resolved."""
    post = BetaPosterior(1.0, 1.0, "literal")
    for a, k in SCRIPT:
        post.update(a, k)
    assert (post.alpha, post.beta) == (9.0, 7.0)


def test_cali_ts_posterior_by_hand():
    """σ_M = 0.2, σ_S = 0.3, θ̂₀ = 0.5; after (2,5),(5,5),(0,3): n = 3, Σa = 7, validated = 3+5+1 = 9,
    θ̂ = 7.5/10 = 0.75; θ_M = 0.4: μ = (0.09·0.4 + 3·0.04·0.75)/(3·0.04 + 0.09) = 0.126/0.21 = 0.6,
    σ² = 1/(1/0.04 + 3/0.09) = 1/58.333 = 0.0171429."""
    calib = GaussianCalibration(0.2, 0.3, 0.5)
    assert calib.posterior(0.4) == pytest.approx((0.4, 0.04))  # n = 0: the prior N(θ_M, σ_M²)
    assert calib.theta_hat == 0.5
    for a, k in SCRIPT[:3]:
        calib.update(a, k)
    assert (calib.n, calib.accepted, calib.validated) == (3, 7, 9)
    assert calib.theta_hat == pytest.approx(0.75)
    mu, var = calib.posterior(0.4)
    assert mu == pytest.approx(0.6)
    assert var == pytest.approx(0.12 / 7)  # 1/58.333...


def test_cali_ts_draws_are_the_clipped_gaussian_then_bernoulli():
    ctl = CaliTS(sigma_m=0.2, sigma_s=0.3, theta0=0.5, seed=7)
    for a, k in SCRIPT[:3]:
        ctl.feedback(chain_round(a, k))
    rng = random.Random(7)
    for depth in range(1, 6):  # no predictor: θ_M = θ̂₀ = 0.5, so μ = (0.09·0.5 + 0.09)/0.21
        theta = min(1.0, max(0.0, rng.gauss(0.135 / 0.21, (0.12 / 7) ** 0.5)))
        expected_stop = not rng.random() < theta
        assert ctl.should_stop(DraftStep(depth, 0, torch.zeros(3), 0.5)) == expected_stop


def test_beta_ts_draws_are_seeded_and_restart_per_prompt():
    a, b = BetaTS(seed=3), BetaTS(seed=3)
    step = DraftStep(1, 0, torch.zeros(3), 0.5)
    assert [a.should_stop(step) for _ in range(50)] == [b.should_stop(step) for _ in range(50)]
    rng = random.Random(3)
    c = BetaTS(seed=3)
    for _ in range(20):  # Beta(1, 1) then Bernoulli, from the same stream
        theta = rng.betavariate(1.0, 1.0)
        assert c.should_stop(step) == (not rng.random() < theta)
    c.feedback(chain_round(4, 5))
    c.start_prompt()
    assert (c.posterior.alpha, c.posterior.beta) == (1.0, 1.0)


def test_specdec_pp_stops_when_rejection_chance_passes_the_threshold():
    rule = SpecDecPP(threshold=0.3)
    rule.start_round()
    probs = [0.9, 0.9, 0.9, 0.9]  # P(all accepted): 0.9, 0.81 (<0.7? no), 0.729, 0.6561 -> 1-0.6561 > 0.3
    stops = [rule.should_stop(DraftStep(d, 0, torch.zeros(3), p)) for d, p in enumerate(probs, 1)]
    assert stops == [False, False, False, True]


def test_specdec_pp_keeps_going_at_exactly_the_threshold():
    """The rule is strict: 1 - 0.5 = 0.5 is not above a threshold of 0.5; 1 - 0.25 is."""
    rule = SpecDecPP(threshold=0.5)
    rule.start_round()
    assert [rule.should_stop(DraftStep(d, 0, torch.zeros(3), 0.5)) for d in (1, 2)] == [False, True]


class Head:
    """A θ predictor whose answer depends only on the step's offset (the rule reads nothing else of it)."""

    def __init__(self, by_offset: dict[int, float]):
        self.by_offset = by_offset

    def target_terms(self, h_T):
        return torch.zeros(2)

    def theta_from_terms(self, terms, h_D, offset):
        return self.by_offset[offset]


def _headed_rule(head: Head, after_token: bool, threshold: float) -> SpecDecPP:
    from types import SimpleNamespace

    rule = SpecDecPP(threshold, 8, SimpleNamespace(last=None), head, after_token)
    rule.start_round()
    rule.round_bias_O2 = torch.zeros(2)  # as after a verification (the stub target has none)
    return rule


def _stops(rule: SpecDecPP, probs: list[float]) -> list[bool]:
    out = []
    for d, p in enumerate(probs, 1):
        out.append(rule.should_stop(DraftStep(d, 0, torch.zeros(3), p, torch.zeros(4))))
        if out[-1]:
            break
    return out


def test_specdec_pp_with_a_head_multiplies_the_heads_acceptances():
    """A head predicting draft i at step i (a Mamba or Transformer drafter's state chose draft i): threshold 0.3,
    head 0.95, 0.95, 0.5: P(all accepted) 0.95, 0.9025, 0.45125 -> stop after draft 3. The drafter's own 0.1 (which
    would stop at once) is not read."""
    rule = _headed_rule(Head({1: 0.95, 2: 0.95, 3: 0.5, 4: 0.5}), after_token=False, threshold=0.3)
    assert _stops(rule, [0.1] * 4) == [False, False, True]


def test_specdec_pp_with_an_early_exit_head_counts_each_draft_once():
    """The early-exit drafter's state at step i comes after draft i, so its head predicts draft i+1 there (the θ
    harvest pairs them so). Draft 1 takes the drafter's own 0.6, drafts 2.. the head's 0.9 from the step before:
    threshold 0.5, P(all accepted) 0.6, 0.54, 0.486 -> stop after draft 3. Multiplying the head's value at each
    step instead (drafts 2..k+1) gave 0.9, 0.81, ... and drafted 7."""
    rule = _headed_rule(Head({i: 0.9 for i in range(1, 9)}), after_token=True, threshold=0.5)
    assert _stops(rule, [0.6, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2]) == [False, False, True]


def test_cali_ts_samples_around_the_heads_theta():
    """n = 0 (no verified round yet this prompt): θ ~ N(θ_M, σ_M²) with θ_M the head's 0.9, not θ̂₀ = 0.5."""
    from types import SimpleNamespace

    ctl = CaliTS(SimpleNamespace(last=None), Head({d: 0.9 for d in range(1, 6)}), sigma_m=0.2, sigma_s=0.3,
                 theta0=0.5, seed=7)
    ctl.start_round()
    ctl.round_bias_O2 = torch.zeros(2)
    rng = random.Random(7)
    for depth in range(1, 6):
        theta = min(1.0, max(0.0, rng.gauss(0.9, 0.2)))
        expected_stop = not rng.random() < theta
        assert ctl.should_stop(DraftStep(depth, 0, torch.zeros(3), 0.5, torch.zeros(4))) == expected_stop


# ---------------------------------------------------------------- through the engine

@pytest.fixture(scope="module")
def drafters(target):
    """The three drafters with a closer Transformer copy, and the throwaway drafter that re-encodes each round."""
    return {**three_drafters(target, VOCAB, noise=0.005),
            "recompute": Recompute(noisy_copy(target.model, noise=0.005), VOCAB)}


def predictor_for(target, drafter, tmp_path, seed=0) -> str:
    torch.manual_seed(seed)
    pred = ThetaPredictor(hidden_size(target.model), hidden_size(drafter.model), mean_label=0.6)
    out = tmp_path / f"theta-{drafter.kind}-{seed}"
    out.mkdir()
    save_predictor(pred, out, {"target_fingerprint": model_fingerprint(target.model),
                               "drafter_fingerprint": model_fingerprint(drafter.model)})
    return str(out)


CONTROLLERS = [("beta_ts", {}), ("cali_ts", {}), ("cali_ts", "predictor"), ("specdec_pp", {}),
               ("specdec_pp", "predictor")]


@pytest.mark.parametrize("kind", ["transformer", "mamba", "mamba2", "eagle3", "feature_mamba2", "recompute"])
@pytest.mark.parametrize("method,options", CONTROLLERS)
def test_controllers_are_lossless_greedy(target, drafters, tmp_path, kind, method, options):
    drafter = drafters[kind]
    if options == "predictor":
        if kind == "recompute":
            pytest.skip("the throwaway drafter gives no hidden state (tested below)")
        options = {"theta_predictor": predictor_for(target, drafter, tmp_path)}
    if method == "specdec_pp":  # these toy drafters' tokens have p ~0.1-0.2: at 0.3 it stops after every draft
        options = {**options, "specpp_threshold": 0.9}
    dec = build_decoder(method, target, drafter, max_draft=6, **options)
    decisions, rule = [], dec.controller.should_stop  # the rule's own stop / go answers, not the budget's cuts
    dec.controller.should_stop = lambda step: decisions.append(rule(step)) or decisions[-1]
    accepted = 0
    for _, res in greedy_runs(dec, target, PROMPTS, (1, 2, 17)):
        assert max(res.stats.drafted_per_round) <= 6
        accepted += sum(res.stats.accepted_per_round)
    assert True in decisions and False in decisions  # the rule both stopped and went on: lengths it chose
    if kind in ("transformer", "recompute"):  # near copies of the target: drafts really get accepted
        assert accepted > 0


def test_cali_ts_reads_both_hidden_states(target, drafters, tmp_path):
    drafter = drafters["mamba2"]
    dec = build_decoder("cali_ts", target, drafter, theta_predictor=predictor_for(target, drafter, tmp_path))
    seen = []
    ctl = dec.controller
    original = ctl.theta_model
    ctl.theta_model = lambda step: seen.append((ctl.round_bias_O2, step.hidden_D)) or original(step)
    dec.generate(PROMPTS[2], max_new_tokens=20)
    assert seen[0][0] is None  # the prompt's first round: no verification yet, θ_M = θ̂₀
    used = [(b, h) for b, h in seen if b is not None]
    assert used and all(b.shape == (10, 2) and h.shape == (32,) for b, h in used)


class HiddenRecorder(StopRule):
    wants_hidden = True

    def __init__(self):
        self.steps = []

    def should_stop(self, step):
        self.steps.append(step)
        return step.depth >= 3


@pytest.mark.parametrize("kind", ["transformer", "mamba", "mamba2"])
def test_drafters_hand_the_hidden_state_that_chose_each_draft(target, drafters, kind):
    """DraftStep.hidden_D equals the drafter's full forward (hidden_states[-1]) at the position before the
    draft: what harvest theta writes as h_draft."""
    drafter = drafters[kind]
    drafter.reset()
    rule = HiddenRecorder()
    seq = PROMPTS[2]
    tree = drafter.draft(seq, StoppableChain(5, rule), SamplingParams(),
                         torch.Generator().manual_seed(0))
    assert len(tree) == 3 and len(rule.steps) == 3
    with torch.no_grad():
        full = drafter.model(torch.tensor([seq + tree.tokens]), output_hidden_states=True).hidden_states[-1][0]
    for step in rule.steps:
        torch.testing.assert_close(step.hidden_D, full[len(seq) + step.depth - 2], rtol=1e-6, atol=1e-6)


def test_hidden_states_cost_nothing_unless_a_rule_asks(target, drafters):
    for kind in ("transformer", "mamba2"):
        drafter = drafters[kind]
        drafter.reset()
        drafter.draft(PROMPTS[1], StoppableChain(3, BetaTS()), SamplingParams(),
                      torch.Generator())
        assert drafter.last_hidden_D is None


def test_posteriors_restart_for_each_prompt(target, drafters):
    dec = build_decoder("beta_ts", target, drafters["transformer"])
    dec.generate(PROMPTS[2], max_new_tokens=20)
    post = dec.controller.posterior
    assert (post.alpha, post.beta) != (1.0, 1.0)
    dec.generate(PROMPTS[1], max_new_tokens=1)  # one token: no drafting round, only the restart
    assert (post.alpha, post.beta) == (1.0, 1.0)
    cali = build_decoder("cali_ts", target, drafters["transformer"], theta0=0.4)
    cali.generate(PROMPTS[2], max_new_tokens=20)
    calib = cali.controller.calib
    assert calib.n > 0 and calib.theta_hat != 0.4
    cali.generate(PROMPTS[1], max_new_tokens=1)
    assert (calib.n, calib.theta_hat) == (0, 0.4)


def test_the_heads_target_state_is_the_row_that_emitted_the_last_token(target, drafters, tmp_path):
    """H_t^T: the target's final hidden state at the position before the last committed token (its logits chose
    that token), checked against one forward over the whole sequence after decodes that end in every way."""
    from draftforge.decode.methods.length_control import target_state

    drafter = drafters["transformer"]
    dec = build_decoder("cali_ts", target, drafter, theta_predictor=predictor_for(target, drafter, tmp_path),
                        max_draft=6)
    for n in (5, 9, 14):
        seq = PROMPTS[2] + dec.generate(PROMPTS[2], max_new_tokens=n).tokens
        with torch.no_grad():
            full = target.model(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0]
        torch.testing.assert_close(target_state(target), full[len(seq) - 2], rtol=0, atol=1e-9)


def test_runs_repeat_exactly_with_a_seed(target, drafters):
    def lengths(seed):
        dec = build_decoder("beta_ts", target, drafters["mamba"], ts_seed=seed)
        return [dec.generate(p, max_new_tokens=17).stats.drafted_per_round for p in PROMPTS]

    assert lengths(1) == lengths(1)
    assert lengths(1) != lengths(2)


# ---------------------------------------------------------------- bad input

@pytest.mark.parametrize("method,options,match", [
    ("beta_ts", {"max_draft": 0}, "--max-draft"),
    ("beta_ts", {"beta_alpha0": 0.0}, "--beta-alpha0"),
    ("beta_ts", {"beta_update": "eq3"}, "--beta-update"),
    ("cali_ts", {"sigma_m": -1.0}, "--sigma-m"),
    ("cali_ts", {"theta0": 1.5}, "--theta0"),
    ("specdec_pp", {"specpp_threshold": 1.0}, "--specpp-threshold"),
])
def test_bad_options_are_one_clear_error(target, drafters, method, options, match):
    with pytest.raises(RecipeError, match=match):
        build_decoder(method, target, drafters["mamba"], **options)


def test_a_theta_predictor_for_another_drafter_is_refused(target, drafters, tmp_path):
    for_mamba = predictor_for(target, drafters["mamba"], tmp_path)
    with pytest.raises(CompatibilityError, match="another target/drafter pair.*drafter weights differ.*; it was trained "
                                                 "for target .*, drafter .*, this is target .*, a mamba drafter"):
        build_decoder("cali_ts", target, drafters["mamba2"], theta_predictor=for_mamba)  # same width, other weights
    with pytest.raises(CompatibilityError, match="drafter hidden size 32 != 64"):
        wide = ThetaPredictor(32, 64)
        out = tmp_path / "wide"
        out.mkdir()
        save_predictor(wide, out, {})
        build_decoder("cali_ts", target, drafters["mamba"], theta_predictor=str(out))
    with pytest.raises(DraftforgeError, match="not a θ predictor export"):
        build_decoder("cali_ts", target, drafters["mamba"], theta_predictor=str(tmp_path))
    cut = predictor_for(target, drafters["mamba"], tmp_path, seed=1)  # a truncated weights file: a traceback before
    weights = Path(cut) / "theta.safetensors"
    weights.write_bytes(weights.read_bytes()[:-16])
    with pytest.raises(CheckpointError, match=r"theta.safetensors cannot be read \(.*\); re-export the theta run"):
        build_decoder("cali_ts", target, drafters["mamba"], theta_predictor=cut)


def test_cali_ts_with_a_drafter_without_hidden_states_says_so(target, drafters, tmp_path):
    recompute = drafters["recompute"]
    pred_dir = tmp_path / "rec"
    pred_dir.mkdir()
    save_predictor(ThetaPredictor(32, 32), pred_dir, {})
    dec = build_decoder("cali_ts", target, recompute, theta_predictor=str(pred_dir))
    with pytest.raises(DraftforgeError, match="gives none in DraftStep.hidden_D"):
        dec.generate(PROMPTS[2], max_new_tokens=12)


# ---------------------------------------------------------------- T > 0: still the target's distribution

@pytest.mark.slow  # ~30 s each on a shared CPU
@pytest.mark.parametrize("method", ["beta_ts", "cali_ts", "specdec_pp"])
def test_sampled_output_follows_the_target_with_a_stop_rule(method):
    """First three tokens (the rule chooses 1 or 2 drafts in round one; SpecDec++'s choice depends on the
    drafted token itself) against the exact product of the target's warped distributions (chi-square)."""
    import itertools

    from draftforge.decode.sampling import probs_from_logits
    from tests.decode.test_sampling import chi_square, chi_square_limit

    vocab, params = 8, {"temperature": 1.0, "top_k": 3}
    target = load_target(tiny_llama(vocab=vocab, hidden=16, layers=1, dtype=torch.float64))
    drafter = load_drafter(noisy_copy(target.model, 0.3), target)
    dec = build_decoder(method, target, drafter, max_draft=4, specpp_threshold=0.5) if method == "specdec_pp" \
        else build_decoder(method, target, drafter, max_draft=4)
    prompt, n, counts, lengths = [1, 2, 3], 1500, {}, set()
    for seed in range(n):
        res = dec.generate(prompt, max_new_tokens=3, seed=seed, **params)
        counts[tuple(res.tokens)] = counts.get(tuple(res.tokens), 0) + 1
        lengths.add(res.stats.drafted_per_round[0])
    sp = SamplingParams(**params)
    exact = {}
    with torch.no_grad():
        for seq in itertools.product(range(vocab), repeat=3):
            p, ctx = 1.0, list(prompt)
            for tok in seq:
                p *= float(probs_from_logits(target.model(torch.tensor([ctx])).logits[0, -1], sp)[tok])
                ctx.append(tok)
                if p == 0:
                    break
            if p > 0:
                exact[seq] = p
    stat, df = chi_square(counts, exact, n)
    assert stat < chi_square_limit(df), (stat, df)
    assert lengths == {1, 2}  # the rule really chose different lengths


def test_a_reduced_vocabulary_drafter_works_with_a_stop_rule(target):
    """The stop rule sees the drafted token's probability through the d2t map (a draft head of 6 of 12 ids)."""
    from draftforge.models.draft_vocab import attach_reduced_head

    model = tiny_mamba2(vocab=VOCAB, dtype=torch.float64)
    attach_reduced_head(model, list(range(0, VOCAB, 2)))
    drafter = load_drafter(model, target)
    rule = HiddenRecorder()
    tree = drafter.draft(PROMPTS[2], StoppableChain(5, rule), SamplingParams(), torch.Generator())
    assert len(tree) == 3 and all(tok % 2 == 0 for tok in tree.tokens)
    assert all(s.logits_V.shape[-1] == VOCAB and s.prob > 0 for s in rule.steps)
    dec = build_decoder("beta_ts", target, drafter)
    assert dec.generate(PROMPTS[1], max_new_tokens=12).tokens == greedy_reference(target, PROMPTS[1], 12)
