"""Draft-length controllers for any chain drafter: Beta-TS, Cali-TS (EESD §3.3, App. A/B) and SpecDec++'s rule.

Each controller is also the `StopRule` of the `StoppableChain` it hands the drafter, so it works with
every drafter that drafts chains (Mamba, Transformer, early-exit). After each drafted token x_i the
TS controllers draw θ, then χ ~ Bernoulli(θ), and stop on χ = 0 (the first token is always drafted;
`max_draft` caps a round, the paper has no cap). Posteriors restart per prompt (`start_prompt`), the
random generator per `reset` (seeded, so runs repeat exactly).

Two of the paper's update rules are broken as printed; we use the resolutions in docs/methods/cali-ts.md §2-§3:
  - Beta-TS Eqs. (3)-(4) are off by one (r = -1 when nothing is accepted, or two failures per rejection).
    With a = accepted drafts and k = drafted: α += a, β += 1[a < k] (`beta_update="resolved"`);
    the literal reading α += a, β += min(2, k - a) is kept as `beta_update="literal"` (ablation).
  - Cali-TS Eq. (8) makes θ̂ -> 1 whatever is accepted. We use θ̂ = (θ̂₀ + Σa) / (1 + Σ min(a+1, k)):
    accepted over validated drafts, the counts Beta-TS uses.
Cali-TS (Eqs. 6-7): μ = (σ_S² θ_M + n σ_M² θ̂) / (n σ_M² + σ_S²), 1/σ² = 1/σ_M² + n/σ_S², θ ~ N(μ, σ²)
clipped to [0, 1]; n = verified rounds of this prompt. θ_M comes from the θ predictor (models/cali_ts.py)
on the target's hidden state at the last verified row and the drafter's hidden state that chose x_i;
without a predictor, or before the prompt's first verification, θ_M = θ̂₀ (the "w/o model" ablation).
SpecDec++ (Huang et al. 2024): stop once 1 - Π_j p_acc(x_j) > threshold. Without a trained head we use the
drafter's own probability of its token as p_acc (a stand-in, not the paper's head); a θ predictor may serve
as the head.

Legend: D hidden size, T target, O offsets (1..10).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Literal

import torch

from draftforge.decode.checks import non_negative, positive, positive_int, unit_interval
from draftforge.decode.control import Controller, Round
from draftforge.decode.engine import SpeculativeDecoder
from draftforge.decode.methods import Method, MethodOptions, option, register_method
from draftforge.decode.plan import DraftStep, StoppableChain, StopRule
from draftforge.errors import DraftforgeError

DEFAULT_MAX_DRAFT = 16  # docs/methods/cali-ts.md §1: K_max for safety (the paper has no cap)


def _check_cap(max_draft) -> int:
    if isinstance(max_draft, bool) or not isinstance(max_draft, int) or max_draft < 1:
        raise DraftforgeError(f"max_draft must be a positive integer, got {max_draft!r}")
    return max_draft


def round_counts(rnd: Round) -> tuple[int, int]:
    """(a, k): accepted drafts and drafted tokens of a chain round."""
    return len(rnd.path), len(rnd.tree)


class BetaPosterior:
    """Beta(α, β) over the per-token acceptance θ of one prompt (EESD App. A, Eq. 2)."""

    def __init__(self, alpha0: float = 1.0, beta0: float = 1.0, update: str = "resolved"):
        if not (alpha0 > 0 and beta0 > 0):
            raise DraftforgeError(f"beta_ts prior must be > 0, got alpha0={alpha0}, beta0={beta0}")
        if update not in ("resolved", "literal"):
            raise DraftforgeError(f"beta_update must be 'resolved' or 'literal', got {update!r}")
        self.alpha0, self.beta0, self.rule = float(alpha0), float(beta0), update
        self.restart()

    def restart(self) -> None:
        self.alpha, self.beta = self.alpha0, self.beta0

    def update(self, a: int, k: int) -> None:
        """After a verification of k drafts of which a were accepted (k = 0: nothing learned)."""
        if k == 0:
            return
        self.alpha += a
        self.beta += (1 if a < k else 0) if self.rule == "resolved" else min(2, k - a)

    def sample(self, rng: random.Random) -> float:
        return rng.betavariate(self.alpha, self.beta)


class GaussianCalibration:
    """Cali-TS's sampling term (EESD App. B): running acceptance mean θ̂ and the Gaussian posterior over μ."""

    def __init__(self, sigma_m: float = 0.2, sigma_s: float = 0.3, theta0: float = 0.5):
        if not (sigma_m > 0 and sigma_s > 0):
            raise DraftforgeError(f"sigma_m and sigma_s must be > 0, got {sigma_m}, {sigma_s}")
        if not 0.0 <= theta0 <= 1.0:
            raise DraftforgeError(f"theta0 must be in [0, 1], got {theta0}")
        self.sigma_m, self.sigma_s, self.theta0 = float(sigma_m), float(sigma_s), float(theta0)
        self.restart()

    def restart(self) -> None:
        self.n, self.accepted, self.validated = 0, 0, 0

    @property
    def theta_hat(self) -> float:
        """Accepted over validated drafts, θ̂₀ as one pseudo-draft (Eq. 8's fix, docs/methods/cali-ts.md §3)."""
        return (self.theta0 + self.accepted) / (1 + self.validated)

    def update(self, a: int, k: int) -> None:
        if k == 0:
            return
        self.n += 1
        self.accepted += a
        self.validated += min(a + 1, k)

    def posterior(self, theta_m: float) -> tuple[float, float]:
        """(μ, σ²) of Eqs. (6)-(7) for the model's prediction θ_M."""
        vm, vs, n = self.sigma_m ** 2, self.sigma_s ** 2, self.n
        mu = (vs * theta_m + n * vm * self.theta_hat) / (n * vm + vs)
        return mu, 1.0 / (1.0 / vm + n / vs)

    def sample(self, theta_m: float, rng: random.Random) -> float:
        mu, var = self.posterior(theta_m)
        return min(1.0, max(0.0, rng.gauss(mu, math.sqrt(var))))


class LengthController(Controller, StopRule):
    """A chain of at most `max_draft` drafts per round, ended by `should_stop`; seeded randomness."""

    def __init__(self, max_draft: int = DEFAULT_MAX_DRAFT, seed: int = 0):
        self.max_draft, self.seed = _check_cap(max_draft), int(seed)
        self.plan = StoppableChain(self.max_draft, self)
        self.reset()

    def next_plan(self):
        return self.plan

    def reset(self) -> None:
        self.rng = random.Random(self.seed)
        self.start_prompt()

    def continue_draw(self, theta: float) -> bool:
        """χ ~ Bernoulli(θ): True = draft another token."""
        return self.rng.random() < theta


class BetaTS(LengthController):
    """Beta-TS (EESD App. A, Alg. 2): a fresh θ ~ Beta(α, β) after each draft, stop when Bernoulli(θ) says 0."""

    def __init__(self, max_draft=DEFAULT_MAX_DRAFT, seed=0, alpha0=1.0, beta0=1.0, update="resolved"):
        self.posterior = BetaPosterior(alpha0, beta0, update)
        super().__init__(max_draft, seed)

    def start_prompt(self) -> None:
        self.posterior.restart()

    def should_stop(self, step: DraftStep) -> bool:
        return not self.continue_draw(self.posterior.sample(self.rng))

    def feedback(self, rnd: Round) -> None:
        self.posterior.update(*round_counts(rnd))


def target_state(target) -> torch.Tensor | None:
    """H_t^T: the target's hidden state at the row that emitted the last committed token (None before
    the prompt's first verification, or when the target keeps no hidden states)."""
    last = getattr(target, "last", None)
    if last is None or last.hidden_ND is None or last.path is None:
        return None
    return last.hidden_ND[1 + last.path[-1] if last.path else 0]


class CaliTS(LengthController):
    """Cali-TS (EESD §3.3, App. B, Alg. 3): θ ~ N(μ, σ²) blending θ_M with the running mean θ̂."""

    def __init__(self, target=None, predictor=None, max_draft=DEFAULT_MAX_DRAFT, seed=0, sigma_m=0.2,
                 sigma_s=0.3, theta0: float | None = None):
        if predictor is not None and target is None:
            raise DraftforgeError("cali_ts with a θ predictor needs the target (its hidden states are H_t^T)")
        if theta0 is None:  # the predictor's mean training acceptance, else 0.5
            theta0 = predictor.mean_label if predictor is not None else 0.5
        self.calib = GaussianCalibration(sigma_m, sigma_s, theta0)
        self.target, self.predictor = target, predictor
        self.wants_hidden = predictor is not None
        if predictor is not None:
            target.want_hidden = True
        self.round_bias_O2 = None
        super().__init__(max_draft, seed)

    def start_prompt(self) -> None:
        self.calib.restart()

    def start_round(self) -> None:
        h_T = target_state(self.target) if self.predictor is not None else None
        self.round_bias_O2 = None if h_T is None else self.predictor.target_terms(h_T)

    def theta_model(self, step: DraftStep) -> float:
        if self.round_bias_O2 is None:
            return self.calib.theta0
        if step.hidden_D is None:
            raise DraftforgeError("cali_ts with a θ predictor needs the drafter's hidden states, but this drafter "
                                  "gives none in DraftStep.hidden_D; use cali_ts without --theta-predictor")
        return self.predictor.theta_from_terms(self.round_bias_O2, step.hidden_D, step.depth)

    def should_stop(self, step: DraftStep) -> bool:
        return not self.continue_draw(self.calib.sample(self.theta_model(step), self.rng))

    def feedback(self, rnd: Round) -> None:
        self.calib.update(*round_counts(rnd))


class SpecDecPP(LengthController):
    """SpecDec++'s deterministic rule: stop once the chance that some draft is rejected exceeds `threshold`.

    After draft k the product runs over p_acc(x_1..x_k). A θ predictor of a drafter whose hidden state at step i
    comes after consuming draft i (`after_token`: the early-exit drafter) predicts draft i+1 there, so its value
    at step k - 1 is x_k's factor, and x_1 (which no step predicts) takes the drafter's own probability."""

    def __init__(self, threshold: float = 0.3, max_draft=DEFAULT_MAX_DRAFT, target=None, predictor=None,
                 after_token: bool = False):
        if not 0.0 < threshold < 1.0:
            raise DraftforgeError(f"specpp_threshold must be in (0, 1), got {threshold}")
        if predictor is not None and target is None:
            raise DraftforgeError("specdec_pp with a θ predictor as its head needs the target")
        self.threshold, self.target, self.predictor = float(threshold), target, predictor
        self.after_token = bool(after_token)
        self.wants_hidden = predictor is not None
        if predictor is not None:
            target.want_hidden = True
        super().__init__(max_draft, 0)

    def start_round(self) -> None:
        self.all_accepted = 1.0  # Π p_acc over this round's drafts
        self.predicted_next = None  # after_token: the predictor's p_acc of the draft to come
        h_T = target_state(self.target) if self.predictor is not None else None
        self.round_bias_O2 = None if h_T is None else self.predictor.target_terms(h_T)

    def _predicted(self, step: DraftStep) -> float | None:
        if self.predictor is None or self.round_bias_O2 is None or step.hidden_D is None:
            return None
        return self.predictor.theta_from_terms(self.round_bias_O2, step.hidden_D, step.depth)

    def acceptance(self, step: DraftStep) -> float:
        """p_acc of draft `step.depth`: the predictor's where it has one, else the drafter's own confidence."""
        if not self.after_token:
            predicted = self._predicted(step)
            return step.prob if predicted is None else predicted
        here = self.predicted_next if step.depth > 1 and self.predicted_next is not None else step.prob
        self.predicted_next = self._predicted(step)  # of draft depth + 1
        return here

    def should_stop(self, step: DraftStep) -> bool:
        self.all_accepted *= self.acceptance(step)
        return 1.0 - self.all_accepted > self.threshold


# ---------------------------------------------------------------- the methods and their options

def _predictor(path, target, drafter):
    if path is None:
        return None
    from draftforge.models.cali_ts import load_predictor

    return load_predictor(path, target.model, drafter, device=target.device)


def _make(name, controller):
    return lambda target, drafter, o: SpeculativeDecoder(name, target, drafter, controller(target, drafter, o))


def _seed_field():
    return option(0, "seed of the Thompson-sampling draws (default 0)", check=lambda v, f: int(non_negative(v, f)))


def _predictor_field():
    return option(None, "a θ predictor export (task theta) for this target/drafter pair (cali_ts: θ_M; specdec_pp: "
                  "head)")


@dataclass(frozen=True)
class DraftCapOptions(MethodOptions):
    max_draft: int = option(DEFAULT_MAX_DRAFT, "cap on drafts per round for beta_ts / cali_ts / specdec_pp "
                            "(default 16)", check=positive_int)


@dataclass(frozen=True)
class BetaTSOptions(DraftCapOptions):
    ts_seed: int = _seed_field()
    beta_alpha0: float = option(1.0, "Beta-TS prior α₀ (default 1)", check=positive)
    beta_beta0: float = option(1.0, "Beta-TS prior β₀ (default 1)", check=positive)
    beta_update: Literal["resolved", "literal"] = option(
        "resolved", "Beta-TS update: resolved (α+=a, β+=1[a<k]; docs/methods/cali-ts.md) or literal (Eqs. 3-4)")


@dataclass(frozen=True)
class CaliTSOptions(DraftCapOptions):
    ts_seed: int = _seed_field()
    theta_predictor: str | None = _predictor_field()
    sigma_m: float = option(0.2, "Cali-TS σ_M, the θ predictor's error (default 0.2)", check=positive)
    sigma_s: float = option(0.3, "Cali-TS σ_S, spread of a round's acceptance mean (default 0.3)", check=positive)
    theta0: float | None = option(None, "Cali-TS θ̂₀ (default: the predictor's mean training acceptance, else 0.5)",
                                  check=unit_interval)


@dataclass(frozen=True)
class SpecDecPPOptions(DraftCapOptions):
    specpp_threshold: float = option(0.3, "SpecDec++: stop once P(some draft rejected) exceeds this (default 0.3)",
                                     check=lambda v, f: unit_interval(v, f, True))
    theta_predictor: str | None = _predictor_field()


register_method(Method(
    "beta_ts", "chains ended by Beta-TS (EESD App. A): θ ~ Beta per draft, stop on Bernoulli(θ) = 0", True,
    _make("beta_ts", lambda t, d, o: BetaTS(o.max_draft, o.ts_seed, o.beta_alpha0, o.beta_beta0, o.beta_update)),
    BetaTSOptions))
register_method(Method(
    "cali_ts", "chains ended by Cali-TS (EESD §3.3, App. B): θ predictor blended with the running mean", True,
    _make("cali_ts", lambda t, d, o: CaliTS(t, _predictor(o.theta_predictor, t, d), o.max_draft, o.ts_seed,
                                            o.sigma_m, o.sigma_s, o.theta0)),
    CaliTSOptions))
register_method(Method(
    "specdec_pp", "chains ended by SpecDec++'s threshold on P(some draft rejected) (drafter prob as p_acc)",
    True, _make("specdec_pp", lambda t, d, o: SpecDecPP(o.specpp_threshold, o.max_draft, t,
                                                        _predictor(o.theta_predictor, t, d),
                                                        getattr(d, "hidden_after_token", False))),
    SpecDecPPOptions))
