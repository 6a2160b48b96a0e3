"""Prompt lookup first, a trained drafter otherwise: each round drafts by copying when the text's last n tokens
(n >= the lookup's min_ngram) occurred earlier in the prompt or the answer, and with the drafter when they did not.

Long documents, code and edits repeat their own text, where lookup drafts long runs for free (HumanEval on SmolLM2,
a chain of 5: lookup alone τ 2.43, lookup first with the EAGLE-3 head capped at depth 2 behind it τ 2.84; a lookup
round costs ~0.02 ms); elsewhere it finds nothing and a trained drafter does better. The choice is made from
the committed text alone, before anything is drafted, so it is not a function of the drafts: every round is verified
by the usual rule for whichever drafter drafted it (lookup's drafts are fixed proposals, verified as such at T > 0),
and decoding stays lossless at every temperature.

The drafter that sits a round out catches up at its next draft: a token drafter folds the committed tokens it has
not seen into its state (as after any round), and a drafter that reads the target takes every feature row the
target has committed since it last drafted. Only the drafter that drafted a round is told what was accepted.
A Mamba drafter's catch-up costs one recurrent step per missed token, so behind a long copied run it pays what
drafting every token would have (at 8k tokens on SmolLM2 this is why lookup first with the Mamba2 drafter decoded
slower than lookup alone). One multi-token forward is no cheaper on a CPU: transformers' chunked Mamba2 scan took
~54 ms for 2 to 16 tokens against ~2 ms a step (a random 4 x 256 Mamba2 with an 8,192-id head, bf16, 1 thread).
Static trees and chains only (lookup has no probabilities for a dynamic tree builder to rank).

`drafter_depth` caps the drafter's rounds at that depth while lookup drafts to the plan's: a copied run is long
and nearly free (HumanEval's best lookup chain is 5), where a trained drafter's later guesses cost a forward each
and are rarely right (the EAGLE-3 head's best chain on SmolLM2 is 1-2).
"""

from __future__ import annotations

from draftforge.decode.drafters.base import Drafter
from draftforge.decode.drafters.lookup import PromptLookupDrafter
from draftforge.decode.plan import DynamicTree, as_plan
from draftforge.decode.sampling import SamplingParams
from draftforge.decode.tree import DraftTree
from draftforge.errors import DraftforgeError

DEFAULT_MIN_NGRAM = 2  # a single repeated token is too weak a hint to set the trained drafter aside


class LookupFirstDrafter(Drafter):
    """`lookup` where it finds a match, else `drafter` (see the module doc). Counts its rounds by who drafted."""

    def __init__(self, lookup: PromptLookupDrafter, drafter: Drafter, drafter_depth: int | None = None):
        if drafter_depth is not None and (isinstance(drafter_depth, bool) or not isinstance(drafter_depth, int)
                                          or drafter_depth < 1):
            raise DraftforgeError(f"lookup-first's drafter depth must be an integer >= 1, got {drafter_depth!r}")
        if isinstance(drafter, (PromptLookupDrafter, LookupFirstDrafter)):
            raise DraftforgeError("lookup-first needs a trained drafter to fall back on; the drafter given is "
                                  f"already prompt lookup ({drafter.kind})")
        self.lookup, self.drafter, self.drafter_depth = lookup, drafter, drafter_depth
        self.kind = f"lookup-first+{drafter.kind}"
        self.reads_target_hidden = drafter.reads_target_hidden
        self.cuda_graphs, self.hidden_after_token = drafter.cuda_graphs, drafter.hidden_after_token
        self.model, self.tokenizer, self.d2t = drafter.model, drafter.tokenizer, drafter.d2t
        self.vocab_size = drafter.vocab_size
        self.target = drafter.target
        if self.target is not None and lookup.target is None:
            lookup.bind(self.target)
        self._last = None  # the drafter of the last round: the one told what was accepted
        self.rounds = {"lookup": 0, "drafter": 0}  # rounds each drafted, over this object's life (reset keeps them)

    def bind(self, target) -> None:
        self.drafter.bind(target)
        self.lookup.bind(target)
        self.target = target

    def attach(self, target):
        verifying = self.drafter.attach(target)
        self.lookup.bind(verifying)
        self.target = verifying
        return verifying

    def reset(self) -> None:
        self.lookup.reset()
        self.drafter.reset()
        self._last = None

    def cache_bytes(self) -> int | None:
        return self.drafter.cache_bytes()

    def check_context(self, positions: int) -> None:
        self.drafter.check_context(positions)  # the trained drafter's limit; lookup has none

    def draft(self, seq: list[int], plan, params: SamplingParams, generator) -> DraftTree:
        plan = as_plan(plan)
        if isinstance(plan, DynamicTree):
            raise DraftforgeError("lookup-first drafts static trees and chains (lookup has no probabilities for a "
                                  "dynamic tree builder to rank); use chain, tree or ucb, or drop lookup-first")
        return self._either(lambda d: d.draft(seq, self._for(d, plan), params, generator))

    def draft_levels(self, seq, shape, params, generator, stop=None) -> DraftTree:
        return self._either(lambda d: d.draft_levels(seq, self._for(d, shape), params, generator, stop))

    def _for(self, who: Drafter, plan):
        """The plan (or tree shape) as `who` drafts it: the drafter's capped at drafter_depth."""
        if who is self.lookup or self.drafter_depth is None:
            return plan
        return plan.capped(self.drafter_depth)

    def _either(self, draft_with) -> DraftTree:
        """Lookup's draft when it has one, else the drafter's; the one that drafted hears what was accepted."""
        tree = draft_with(self.lookup)
        self._last, who = (self.lookup, "lookup") if len(tree) else (self.drafter, "drafter")
        if who == "drafter":
            tree = draft_with(self.drafter)
        self.rounds[who] += 1
        return tree

    def accept(self, path: list[int]) -> None:
        if self._last is not None:
            self._last.accept(path)
        self._last = None

    def accept_levels(self, path: list[int]) -> None:
        self.accept(path)

    @property
    def steps_per_draft(self) -> str:
        return f"none where lookup finds a match, else {self.drafter.steps_per_draft}"

    def teacher_forced(self, ids_1S):
        raise DraftforgeError("lookup-first mixes two drafters round by round, so there is no single drafter's "
                              "teacher-forced pass to harvest; harvest with the trained drafter alone")
