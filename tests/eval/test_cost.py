"""The eval's cost model by hand: t(N) read off a known curve, and the speedup it predicts from τ, rows and
draft time per round."""

from collections import Counter
from fractions import Fraction

import pytest

from draftforge.decode.base import DecodeStats
from draftforge.eval import cost
from draftforge.eval.metrics import RunRecord

CURVE = {1: 0.030, 2: 0.031, 4: 0.032, 8: 0.040}  # seconds: flat to 4 rows, then rising (a bf16 CPU's shape)


def test_t_of_is_exact_where_measured_linear_between_and_flat_past_the_ends():
    assert cost.t_of(CURVE, 4) == 0.032
    assert cost.t_of(CURVE, 6) == pytest.approx(0.036)  # halfway from 4 to 8
    assert cost.t_of(CURVE, 3) == pytest.approx(0.0315)
    assert cost.t_of(CURVE, 20) == 0.040 and cost.t_of({2: 0.5, 3: 0.6}, 1) == 0.5


def record(drafted, accepted, draft_s):
    stats = DecodeStats(new_tokens=sum(accepted) + len(accepted), target_forwards=len(accepted),
                        accepted_per_round=accepted, drafted_per_round=drafted,
                        proposed_by_position=[len(drafted)] * max(drafted), draft_time_s=draft_s)
    return RunRecord("chain", 0.0, 0, "p", 4, [0] * stats.new_tokens, stats)


def test_prediction_by_hand():
    recs = [record([3, 3], [3, 1], 0.004), record([7], [2], 0.003)]  # rows 4, 4, 8; draft 7 ms over 3 rounds
    summary = {"tau": 9 / 3, "time": {"draft_s": 0.007}, "speedup": 2.1, "decode_speedup": 2.4}
    got = cost.predict(summary, recs, CURVE)
    verify = (0.032 + 0.032 + 0.040) / 3
    assert got["rows_per_round"] == pytest.approx(16 / 3) and got["verify_s_per_round"] == pytest.approx(verify)
    assert got["predicted_speedup"] == pytest.approx(3.0 * 0.030 / (verify + 0.007 / 3))
    assert got["measured_over_predicted"] == pytest.approx(2.1 / got["predicted_speedup"])
    assert got["decode_over_predicted"] == pytest.approx(2.4 / got["predicted_speedup"])  # the prefill left out
    assert got["draft_steps_per_round"] == pytest.approx((3 + 3 + 7) / 3)  # every round drafted its max depth
    lines = cost.prediction_markdown([{"method": "chain", "temperature": 0.0, "cost_model": got}])
    row = next(line for line in lines if line.startswith("| chain |"))
    predicted = 3.0 * 0.030 / (verify + 0.007 / 3)  # 2.43×: the cells end to end · decoding only
    assert f"| {predicted:.2f}× | 2.10× · 2.40× | {2.1 / predicted:.2f} · {2.4 / predicted:.2f} |" in row
    no_decode = cost.predict({k: v for k, v in summary.items() if k != "decode_speedup"}, recs, CURVE)
    assert no_decode["decode_over_predicted"] is None
    lines = cost.prediction_markdown([{"method": "chain", "temperature": 0.0, "cost_model": no_decode}])
    assert next(line for line in lines if line.startswith("| chain |")).endswith(f"| 2.10× | {2.1 / predicted:.2f} |")


def test_rows_beyond_the_grid_are_named_for_timing():
    assert cost.missing_rows(CURVE, [record([12, 3], [1, 1], 0.0)]) == [13]
    assert cost.missing_rows(CURVE, [record([3], [1], 0.0)]) == []


def test_shorter_chains_by_hand():
    # rounds (accepted, drafted): (3, 3), (1, 3), (2, 7); 7 ms of drafting over 13 steps
    recs = [record([3, 3], [3, 1], 0.004), record([7], [2], 0.003)]
    summary = {"tau": 9 / 3, "time": {"draft_s": 0.007}, "speedup": 2.1}
    got = cost.predict(summary, recs, CURVE)
    step = 0.007 / 13
    cut = got["shorter_chains"]
    assert sorted(cut) == list(range(1, 8))
    # γ' = 1: every round keeps min(a, 1) = 1 draft + 1 token (τ 2), verifies 2 rows, drafts 1 step
    assert cut[1] == pytest.approx(2 * 0.030 / (0.031 + step))
    # γ' = 2: min(a, 2) = 2, 1, 2 -> τ 8/3; 3 rows each (t(3) = 0.0315)
    assert cut[2] == pytest.approx(8 / 3 * 0.030 / (0.0315 + 2 * step))
    # γ' = 7: the rounds as they ran (rows 4, 4, 8; 3, 3, 7 steps): the method's own prediction
    assert cut[7] == pytest.approx(got["predicted_speedup"])
    # γ' = 3: min(a, 3) = 3, 1, 2 -> τ 3; 4 rows each (t(4) = 0.032), 3 steps: 2.68, ahead of 2's 2.46 and of the
    # longer ones, whose extra rows and steps buy no accepted token here
    assert cut[3] == pytest.approx(3 * 0.030 / (0.032 + 3 * step))
    assert got["best_chain_length"] == 3 and max(cut, key=cut.get) == 3
    lines = cost.prediction_markdown([{"method": "chain", "temperature": 0.0, "cost_model": got}])
    assert any(line.startswith("- chain T=0: 1: ") and f"**{got['best_chain_length']}: " in line for line in lines)


def test_a_drafters_prompt_encoding_is_paid_once_per_decode_whatever_the_cut():
    """The cut chains priced every draft second per step, so a drafter's once-per-decode prompt encoding (inside
    its first draft) shrank with γ' and short chains looked cheaper than they are. Two decodes of ten chain-5
    rounds, every draft accepted, a flat t(N) of 50 ms, 5 ms a drafter step and 5 s of prompt encoding each."""
    curve = {n: 0.050 for n in range(1, 9)}
    recs = []
    for i in range(2):
        stats = DecodeStats(new_tokens=60, target_forwards=10, accepted_per_round=[5] * 10, drafted_per_round=[5] * 10,
                            proposed_by_position=[10] * 5, draft_time_s=5.0 + 50 * 0.005,
                            first_draft_time_s=5.0 + 5 * 0.005, first_draft_depth=5)
        recs.append(RunRecord("chain", 0.0, 0, f"p{i}", 4, [0] * 60, stats))
    assert cost.draft_costs(recs) == pytest.approx((0.005, 5.0))
    summary = {"tau": 6.0, "time": {"draft_s": 10.5}, "speedup": 0.5}
    got = cost.predict(summary, recs, curve)
    cut = got["shorter_chains"]
    # cut at γ': γ'+1 tokens a round, 120 / (γ'+1) rounds of 50 ms + 5γ' ms, and 10 s of encoding over 120 tokens
    for g in range(1, 6):
        assert cut[g] == pytest.approx(120 * 0.050 / (120 / (g + 1) * (0.050 + 0.005 * g) + 10.0))
    assert cut[5] == pytest.approx(got["predicted_speedup"]) and got["best_chain_length"] == 5
    assert cut[1] == pytest.approx(0.4511, abs=1e-4)  # the old pricing said 0.645, ahead of γ' = 5's 0.522


def test_a_method_with_its_own_verification_curve_is_priced_on_it_against_the_targets_t1():
    """EESD's verification runs layers N+1..L only: its rounds are priced on that curve, AR's t(1) stays the whole
    target's. Rounds as in test_prediction_by_hand (rows 4, 4, 8; 7 ms drafting over 3 rounds)."""
    recs = [record([3, 3], [3, 1], 0.004), record([7], [2], 0.003)]
    summary = {"tau": 3.0, "time": {"draft_s": 0.007}, "speedup": 2.1}
    own = {1: 0.012, 4: 0.014, 8: 0.020}
    got = cost.predict(summary, recs, CURVE, verify=own)
    verify = (0.014 + 0.014 + 0.020) / 3
    assert got["verify_s_per_round"] == pytest.approx(verify) and got["verify_curve"] == "own"
    assert got["predicted_speedup"] == pytest.approx(3.0 * 0.030 / (verify + 0.007 / 3))
    assert got["shorter_chains"][7] == pytest.approx(got["predicted_speedup"])
    # γ' = 1: τ 2, 2 rows on the own curve (linear between 1 and 4: 12 + 2/3 ms), one step of 7/13 ms
    assert got["shorter_chains"][1] == pytest.approx(0.030 / ((0.012 + 0.002 / 3 + 0.007 / 13) / 2))
    assert cost.predict(summary, recs, CURVE)["verify_curve"] == "target"
    # several length buckets: the own curve was timed at one length only, so the buckets' curves price it
    by_length = {512: CURVE, 1024: CURVE}
    assert cost.predict(summary, recs, CURVE, by_length, verify=own)["verify_curve"] == "target"


def test_a_tree_gets_no_shorter_chains():
    tree = record([12], [3], 0.002)
    tree.stats.proposed_by_position = [1, 1, 1, 1]  # 12 drafts over 4 depths: not a chain
    assert cost.predict({"tau": 4.0, "time": {"draft_s": 0.002}}, [tree], CURVE)["shorter_chains"] == {}
    assert cost.predict({"tau": 1.0, "time": {"draft_s": 0.0}}, [record([1], [1], 0.0)], CURVE)["shorter_chains"] == {}


def test_pace_warning_by_hand():
    """AR's passes at one temperature 100 and 130 tok/s (1.30x apart) or t(1) 10 -> 12 ms (+20%): the report says
    so; 100 and 110 tok/s with t(1) 10 -> 11 ms (within 1.15x), or 100 at T = 0 and 130 at T = 1 (other tokens,
    other lengths: not the same work): it does not."""
    from draftforge.decode.base import DecodeStats
    from draftforge.eval.cost import pace_warning
    from draftforge.eval.metrics import RunRecord

    def ar(rep, temp, tok_s):
        return RunRecord("ar", temp, rep, "p", 3, [], DecodeStats(new_tokens=100, total_time_s=100 / tok_s))

    steady = [ar(0, 0.0, 100.0), ar(1, 0.0, 110.0), RunRecord("chain", 0.0, 0, "p", 3, [], DecodeStats(
        new_tokens=100, total_time_s=0.1))]
    assert pace_warning(steady, {"t1_s": 0.011, "t1_before_s": 0.010}) is None
    assert pace_warning([ar(0, 0.0, 100.0), ar(0, 1.0, 130.0)], None) is None
    moved = pace_warning([ar(0, 0.0, 100.0), ar(1, 0.0, 104.0), ar(0, 1.0, 100.0), ar(1, 1.0, 130.0)], None)
    assert "AR at T = 1 ran at 100.0–130.0 tok/s over its 2 timed passes (1.30×)" in moved
    slowed = pace_warning(steady, {"t1_s": 0.012, "t1_before_s": 0.010})
    assert "t(1) was 10.0 ms before the runs and 12.0 ms after (+20%)" in slowed


def test_length_buckets_by_hand():
    """Powers of two from 512 up: every short prompt in one bucket, 1k / 2k / 4k / 8k prompts in their own."""
    assert [cost.length_bucket(n) for n in (1, 300, 512, 513, 1024, 1025, 2000, 7900)] == \
        [512, 512, 512, 1024, 1024, 2048, 2048, 8192]
    assert cost.bucket_prompts([100, 900, 40, 1000, 3000]) == {512: 0, 1024: 1, 4096: 4}  # each bucket's first
    by_length = {512: {1: 0.1}, 2048: {1: 0.2}}
    assert cost.curve_for(by_length, 2000) is by_length[2048]
    assert cost.curve_for(by_length, 1000) is by_length[512]  # no 1024 curve: the nearest below
    assert cost.curve_for({2048: {1: 0.2}}, 10) == {1: 0.2}  # nothing below: the smallest


def long_record(prompt_len, drafted, accepted, draft_s):
    r = record(drafted, accepted, draft_s)
    r.prompt_len = prompt_len
    return r


def test_each_record_is_priced_at_its_own_length_by_hand():
    """Two prompts, one at 1k and one at 8k, whose chains verify 4 and 8 rows: t(N) comes from each prompt's own
    bucket, AR's t(1) is the tokens' average of the two buckets' t(1), and each bucket gets its own prediction."""
    short, long_ = {1: 0.030, 4: 0.036, 8: 0.045}, {1: 0.050, 4: 0.090, 8: 0.140}
    by_length = {1024: short, 8192: long_}
    recs = [long_record(1000, [3], [3], 0.001), long_record(8000, [7, 7], [2, 0], 0.004)]  # 4 and 4 new tokens
    summary = {"tau": 8 / 3, "time": {"draft_s": 0.005}}
    got = cost.predict(summary, recs, short, by_length)
    verify = (0.036 + 0.140 + 0.140) / 3
    t1 = (4 * 0.030 + 4 * 0.050) / 8
    assert got["verify_s_per_round"] == pytest.approx(verify)
    assert got["predicted_speedup"] == pytest.approx(8 / 3 * t1 / (verify + 0.005 / 3))
    at_8k = got["by_length"][8192]
    assert at_8k["tau"] == 2.0 and at_8k["t1_s"] == 0.050  # 4 tokens in 2 rounds
    assert at_8k["predicted_speedup"] == pytest.approx(2.0 * 0.050 / (0.140 + 0.004 / 2))
    step = 0.004 / 14  # 14 drafted steps at 8k
    # γ' = 1 at 8k: both rounds keep 1 draft + 1 token... the second accepted none: τ (2 + 1) / 2, 2 rows each
    t2 = 0.050 + (0.090 - 0.050) / 3  # linear between 1 and 4 rows
    assert at_8k["shorter_chains"][1] == pytest.approx(1.5 * 0.050 / (t2 + step))
    assert got["by_length"][1024]["predicted_speedup"] == pytest.approx(4.0 * 0.030 / (0.036 + 0.001))
    one = cost.predict(summary, recs, short)  # without by_length: everything at the first curve, as before
    assert "by_length" not in one
    assert one["verify_s_per_round"] == pytest.approx((0.036 + 0.045 + 0.045) / 3)
    lines = cost.prediction_markdown([{"method": "chain", "temperature": 0.0, "cost_model": got}])
    assert any(line.startswith("| chain | 0 | ≤8192 | 2.00 |") for line in lines)


class CountingTarget:
    """Counts prefills and the context each verification ran on (tokens committed since the prefill)."""

    device = "cpu"

    def __init__(self):
        self.prefills, self.contexts, self.length = 0, [], 0

    def prefill(self, seq):
        self.prefills += 1
        self.length = len(seq) - 1

    def verify(self, last, tree):
        self.contexts.append(self.length)

    def commit(self, path):
        self.length += 1 + len(path)


def test_the_curve_encodes_a_long_prompt_once_per_sixtyfourth_of_its_length():
    """A 6,400-token prompt: each verification keeps its root, so the context grows a token per call; the prompt
    is encoded again only after 100 calls (1/64 of its length), and no call runs on more than 100 extra tokens.
    A 10-token prompt is encoded again before every call (grown by 1 >= max(1, 10 // 64))."""
    target = CountingTarget()
    cost.verify_curve(target, list(range(6400)), [1, 2, 4], repeats=2)
    calls = len(target.contexts)
    assert target.prefills == -(-calls // 100)
    assert min(target.contexts) == 6399 and max(target.contexts) <= 6399 + 99
    short = CountingTarget()
    cost.verify_curve(short, list(range(10)), [1, 2], repeats=2)
    assert short.prefills == len(short.contexts) and set(short.contexts) == {9}


def steady_t(n: int) -> Fraction:
    """t(N) = 1 + 0.1 (N - 1) ms, exact (a Fraction: the fake clock's seconds add up without rounding, so the
    number of verifications a sample averages, ceil(SAMPLE_S / t), is not at the mercy of a last bit)."""
    return Fraction(10 + (n - 1), 10_000)


class ClockedTarget:
    """A target on a fake clock: a verification of N rows advances it by steady_t(N), except its first `slow`
    verifications of one row, which take 100 ms each (a cold start). A prefill advances it by 50 ms, which no
    sample may hold. Counts its verifications per row count."""

    device = "cpu"

    def __init__(self, slow: int = 0):
        self.now, self.slow, self.verified = Fraction(0), slow, Counter()

    def prefill(self, seq):
        self.now += Fraction(1, 20)

    def verify(self, last, tree):
        n = 1 + len(tree)
        self.verified[n] += 1
        self.now += Fraction(1, 10) if n == 1 and self.verified[1] <= self.slow else steady_t(n)

    def commit(self, path):
        pass


def test_the_curve_is_the_median_of_steady_samples_each_averaging_sample_s_of_verifications(monkeypatch):
    """t(N) = 1, 1.1, 1.3, 1.7 ms for N = 1, 2, 4, 8 on a fake clock. Each sample averages enough verifications
    to span SAMPLE_S = 5 ms: ceil(5 / t) = 5, 5 (4.5), 4 (3.8) and 3 (2.9), after two untimed warm-up calls each;
    the curve is those steady values exactly (the prefills' 50 ms each in no sample)."""
    assert cost.SAMPLE_S == 0.005
    target = ClockedTarget()
    monkeypatch.setattr(cost, "_clock", lambda device: target.now)
    got = cost.verify_curve(target, list(range(10)), [8, 2, 1, 4, 2], repeats=5)
    assert got == pytest.approx({1: 0.0010, 2: 0.0011, 4: 0.0013, 8: 0.0017}, rel=1e-12, abs=0)
    assert dict(target.verified) == {1: 2 + 5 * 5, 2: 2 + 5 * 5, 4: 2 + 5 * 4, 8: 2 + 5 * 3}


def test_a_slow_start_stays_out_of_the_curve(monkeypatch):
    """The target's first two verifications of one row take 100 ms: the untimed warm-up call and t(1)'s first timed
    sample. The median of t(1)'s five samples (100, 1, 1, 1, 1 ms) is the steady 1 ms; a max or a mean would put
    the cold start into t(1), the denominator of every predicted speedup. The other row counts, timed after the
    slow start, still average SAMPLE_S of verifications per sample."""
    target = ClockedTarget(slow=2)
    monkeypatch.setattr(cost, "_clock", lambda device: target.now)
    got = cost.verify_curve(target, list(range(10)), [1, 2, 4, 8], repeats=5)
    assert got == pytest.approx({1: 0.0010, 2: 0.0011, 4: 0.0013, 8: 0.0017}, rel=1e-12, abs=0)
    assert [target.verified[n] for n in (2, 4, 8)] == [2 + 5 * 5, 2 + 5 * 4, 2 + 5 * 3]


def test_a_cold_first_call_does_not_set_how_many_verifications_a_sample_averages(monkeypatch):
    """The first verification of all (100 ms, a cold start) set t(1)'s averaging to one call, so every t(1) sample
    was a single sub-millisecond forward: the clock noise SAMPLE_S is there to average out. It is untimed now, and
    the next call sets the count: five calls a sample, as without the cold start."""
    target = ClockedTarget(slow=1)
    monkeypatch.setattr(cost, "_clock", lambda device: target.now)
    got = cost.verify_curve(target, list(range(10)), [1, 2, 4, 8], repeats=5)
    assert got == pytest.approx({1: 0.0010, 2: 0.0011, 4: 0.0013, 8: 0.0017}, rel=1e-12, abs=0)
    assert target.verified[1] == 2 + 5 * 5


def test_a_round_ended_by_an_eos_draft_counts_what_it_emitted():
    """Chain of 3, rounds accepting 3, 3 and 2 drafts where the last round's 2nd draft is the EOS: 4 + 4 + 2 = 10
    tokens (no bonus after an EOS). The histogram and the cut chains count 10, not 11; uncut, the cut equals the
    method's own prediction."""
    from draftforge.eval.metrics import tau_histogram

    stats = DecodeStats(new_tokens=10, target_forwards=3, accepted_per_round=[3, 3, 2], drafted_per_round=[3, 3, 3],
                        proposed_by_position=[3, 3, 3], draft_time_s=0.009)
    rec = RunRecord("chain", 0.0, 0, "p", 4, [0] * 10, stats)
    assert tau_histogram([stats]) == {4: 2, 2: 1}
    got = cost.predict({"tau": 10 / 3, "time": {"draft_s": 0.009}}, [rec], CURVE)
    step = 0.009 / 9
    cut = got["shorter_chains"]
    assert cut[3] == pytest.approx(got["predicted_speedup"]) == pytest.approx(10 / 3 * 0.030 / (0.032 + 3 * step))
    assert cut[2] == pytest.approx(8 / 3 * 0.030 / (0.0315 + 2 * step))  # 3, 3 and the EOS round's own 2
    assert cut[1] == pytest.approx(2 * 0.030 / (0.031 + step))  # every round: 1 draft + the target's token
