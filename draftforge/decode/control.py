"""Controllers: choose the draft plan of the next round, and learn from its outcome.

One protocol: `next_plan()` returns a draft plan (plan.py: a StaticTree, a StoppableChain, a DynamicTree)
or None for a round without drafts; after each round the engine calls `feedback(Round)`; `reset()` forgets
what was learned and `start_prompt()` marks a new prompt. The static controllers here hand out one
StaticTree (a chain of length K is the widths (1,)*K); UCB picks one of its arms' StaticTrees.
UCB follows Mamba Drafters §4.2: k* = argmax_k r̂_k + λ_UCB·sqrt(2 ln t / n_k), reward
r = -(1/N_accept + λ_γ·γ/N_accept), where N_accept is the tokens emitted by the round (bonus
included, so >= 1) and γ the draft depth (one drafter forward per depth with batch expansion), so
-r is proportional to the round's latency per token, (T_target + γ·T_draft) / N_accept / T_target.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from draftforge.decode.plan import DynamicTree, StaticTree
from draftforge.decode.tree import DraftTree
from draftforge.decode.tree_shape import TreeShape, as_shape
from draftforge.errors import DraftforgeError

DEFAULT_UCB_TREES = ((1, 1, 1, 1, 1), (2, 2, 1, 1), (3, 2, 2, 1), (4, 2, 1), (2, 1, 1, 1, 1, 1))


@dataclass
class Round:
    """What one round did: the plan, the tree drafted, the accepted path, the tokens it emitted, its timing."""

    plan: object
    tree: DraftTree
    path: list[int]
    n_emitted: int  # accepted drafts + the bonus / correction token
    draft_time_s: float
    verify_time_s: float

    @property
    def shape(self) -> TreeShape | None:
        """The static tree drafted; None for other plans."""
        return self.plan.tree if isinstance(self.plan, StaticTree) else None


class Controller:
    def next_plan(self):
        """The next round's draft plan (None: no draft)."""
        raise NotImplementedError

    def feedback(self, rnd: Round) -> None:
        """After a round; fixed controllers ignore it."""

    def reset(self) -> None:
        """Forget what was learned (eval calls it before each timed repeat); fixed controllers hold nothing."""

    def start_prompt(self) -> None:
        """A new prompt was prefilled (the engine calls it once per generate); per-prompt posteriors restart here."""


class NoDraft(Controller):
    """Autoregressive decoding: no draft, one target forward per token."""

    def next_plan(self):
        return None


class FixedTree(Controller):
    """The same static tree every round (given as widths or a TreeShape)."""

    def __init__(self, tree):
        self.plan = StaticTree(tree)

    def next_plan(self):
        return self.plan


class FixedChain(FixedTree):
    def __init__(self, k: int):
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise DraftforgeError(f"chain_length must be a positive integer, got {k!r}")
        super().__init__((1,) * k)


class UCBTree(Controller):
    """UCB1 bandit over tree configurations (Mamba Drafters §4.2).

    lambda_gamma=None measures λ_γ ≈ T_draft/T_target online: mean time of one drafter step (draft time / γ)
    over mean time of one target forward, over the rounds so far. Each prompt's first drafting round is left
    out of the drafter's side: there the drafter also encodes the prompt, a cost paid once per decode whatever
    the arm, which counted as steps made λ_γ several times too large (and penalised whichever arm came first).
    An arm's mean reward is kept as its two parts, mean 1/N and mean γ/N, and valued with the current λ_γ, so
    the pulls made while λ_γ was still being measured are not frozen at an early estimate.
    """

    def __init__(self, candidates=DEFAULT_UCB_TREES, ucb_lambda: float = 0.1, lambda_gamma: float | None = None):
        self.arms = [as_shape(c) for c in (candidates or DEFAULT_UCB_TREES)]
        self.plans = [StaticTree(arm) for arm in self.arms]
        if ucb_lambda < 0 or (lambda_gamma is not None and lambda_gamma < 0):
            raise DraftforgeError("ucb_lambda and lambda_gamma must be >= 0")
        self.ucb_lambda, self.fixed_lambda_gamma = ucb_lambda, lambda_gamma
        self.reset()

    def reset(self) -> None:
        self.counts = [0] * len(self.arms)
        self.inverse_sums = [0.0] * len(self.arms)  # Σ 1/N over an arm's pulls
        self.depth_sums = [0.0] * len(self.arms)  # Σ γ/N
        self.t = 0
        self.draft_step_time = self.target_time = 0.0
        self.draft_steps = self.target_rounds = 0
        self.encoding_pending = False  # the prompt's first drafting round is still to come

    def start_prompt(self) -> None:
        self.encoding_pending = True

    @property
    def lambda_gamma(self) -> float:
        if self.fixed_lambda_gamma is not None:
            return self.fixed_lambda_gamma
        if not self.draft_steps or not self.target_time:
            return 0.0
        return (self.draft_step_time / self.draft_steps) / (self.target_time / self.target_rounds)

    @property
    def reward_sums(self) -> list[float]:
        """Σ r over each arm's pulls, r = -(1/N + λ_γ·γ/N), at the current λ_γ."""
        lam = self.lambda_gamma
        return [-(inv + lam * dep) for inv, dep in zip(self.inverse_sums, self.depth_sums)]

    def scores(self) -> list[float]:
        sums = self.reward_sums
        return [
            sums[k] / self.counts[k] + self.ucb_lambda * math.sqrt(2 * math.log(self.t) / self.counts[k])
            for k in range(len(self.arms))
        ]

    def next_plan(self) -> StaticTree:
        self.t += 1
        untried = [k for k, n in enumerate(self.counts) if n == 0]
        scores = self.scores() if not untried else None
        self.last_arm = untried[0] if untried else max(range(len(self.arms)), key=scores.__getitem__)
        return self.plans[self.last_arm]

    def feedback(self, rnd: Round) -> None:
        self.record(rnd.shape, rnd.n_emitted, rnd.draft_time_s, rnd.verify_time_s)

    def record(self, shape: TreeShape | None, n_emitted, draft_time_s=0.0, verify_time_s=0.0) -> None:
        """Learn from a round of the last arm: its timing (for λ_γ) always, but for the drafter's time in a
        prompt's first drafting round (it includes encoding the prompt); its reward only where it drafted the
        arm's whole tree. At the token budget's end the engine cuts the tree to the tokens left (or drafts nothing,
        shape None), which caps N_accept whatever the arm is worth, and deep arms would be cut most."""
        if self.encoding_pending and _depth(shape):
            self.encoding_pending = False
        else:
            self.draft_step_time += draft_time_s
            self.draft_steps += _depth(shape)
        self.target_time += verify_time_s
        self.target_rounds += 1
        arm = self.last_arm
        if shape != self.arms[arm]:
            return
        self.counts[arm] += 1
        self.inverse_sums[arm] += 1.0 / n_emitted
        self.depth_sums[arm] += _depth(shape) / n_emitted

    def arm_name(self) -> str:
        return self.arms[self.last_arm].name


def _depth(shape: TreeShape | None) -> int:
    return shape.depth if shape is not None else 0


class BuilderController(Controller):
    """Hands the drafter the same dynamic plan every round (EAGLE-2, C2T)."""

    def __init__(self, plan: DynamicTree):
        self.plan = plan

    def next_plan(self):
        return self.plan
