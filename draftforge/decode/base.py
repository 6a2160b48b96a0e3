"""Shared result types of the decoding harness; the eval reports are computed from these.

Conventions: a *round* is one target verification forward. tau counts tokens emitted per
round, so it includes the bonus/correction token; `accepted_per_round` excludes it.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class DecodeStats:
    new_tokens: int = 0  # tokens emitted (excluding the prompt)
    target_forwards: int = 0  # verification rounds after prefill (AR: one per token)
    accepted_per_round: list[int] = field(default_factory=list)  # draft tokens accepted, bonus excluded
    drafted_per_round: list[int] = field(default_factory=list)  # gamma: candidates verified per round
    accept_by_position: list[int] = field(default_factory=list)  # [d] accepted drafts at depth d (0-based)
    proposed_by_position: list[int] = field(default_factory=list)  # [d] rounds that proposed depth d
    prefill_time_s: float = 0.0
    draft_time_s: float = 0.0
    verify_time_s: float = 0.0
    # the first round's drafting, where a drafter with a cache or state encodes the prompt (once per decode), and
    # its depth: the cost model tells that fixed cost from the per-step one (0: not recorded)
    first_draft_time_s: float = 0.0
    first_draft_depth: int = 0
    total_time_s: float = 0.0  # wall time of the whole generate() call, prefill included
    chosen_configs: list[str] = field(default_factory=list)  # controller's choice per round (e.g. UCB arm)
    # context state held when the decode ended (decode/memory.py; None: the object does not say)
    target_cache_bytes: int | None = None  # the target's KV cache / SSM state
    drafter_state_bytes: int | None = None  # the drafter's committed cache or state (not a round's tree)

    def add_round(self, accepted: int, drafted: int, depth: int, config: str) -> None:
        """One verification round: `drafted` candidates down to `depth`, of which the first `accepted` along
        the root path were kept; `config` names the round's choice. Keeps the per-round lists in step."""
        self.target_forwards += 1
        self.accepted_per_round.append(accepted)
        self.drafted_per_round.append(drafted)
        for lst in (self.accept_by_position, self.proposed_by_position):
            lst.extend([0] * (depth - len(lst)))
        for d in range(depth):
            self.proposed_by_position[d] += 1
        for d in range(accepted):
            self.accept_by_position[d] += 1
        self.chosen_configs.append(config)

    @property
    def tau(self) -> float:
        """Tokens emitted per target forward (bonus token counted)."""
        return self.new_tokens / max(self.target_forwards, 1)

    @property
    def tau_no_bonus(self) -> float:
        """Mean draft tokens accepted per round that drafted (bonus token not counted).

        A round with nothing drafted (e.g. a prompt's last round, with one token left) cannot accept
        anything, so it is not counted; a round whose drafted count is unknown (older stats) is.
        """
        drafted = self.drafted_per_round
        kept = [a for i, a in enumerate(self.accepted_per_round) if i >= len(drafted) or drafted[i] > 0]
        return sum(kept) / len(kept) if kept else 0.0

    @property
    def other_time_s(self) -> float:
        return max(self.total_time_s - self.prefill_time_s - self.draft_time_s - self.verify_time_s, 0.0)


@dataclass
class DecodeResult:
    tokens: list[int]  # generated token ids, prompt excluded, EOS included if produced
    stats: DecodeStats
