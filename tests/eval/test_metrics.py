"""Eval metrics against hand computation."""

from types import SimpleNamespace

import pytest
import torch

from draftforge.decode.base import DecodeStats
from draftforge.eval import metrics, selfcheck
from draftforge.eval.metrics import RunRecord


def rec(method, stats, repeat=0, pid="p0", tokens=(1, 2, 3), temperature=0.0):
    return RunRecord(method, temperature, repeat, pid, 4, list(tokens), stats)


def chain_stats():
    # 3 rounds of K=3 drafts: accepted 3, 1, 0 → emitted 4 + 2 + 1 = 7 tokens in 3 forwards
    return DecodeStats(new_tokens=7, target_forwards=3, accepted_per_round=[3, 1, 0], drafted_per_round=[3, 3, 3],
                       accept_by_position=[2, 1, 1], proposed_by_position=[3, 3, 3],
                       prefill_time_s=0.1, draft_time_s=0.2, verify_time_s=0.3, total_time_s=0.7)


def ar_stats(n=7, secs=1.4):
    return DecodeStats(new_tokens=n, target_forwards=n, total_time_s=secs, verify_time_s=secs)


def test_summarize_chain_by_hand():
    s = metrics.summarize([rec("chain", chain_stats())], [rec("ar", ar_stats())])
    assert s["tau"] == pytest.approx(7 / 3)
    assert s["tau_no_bonus"] == pytest.approx(4 / 3)
    assert s["gamma_total"] == 9
    assert s["acceptance_rate"] == pytest.approx(4 / 9)
    assert s["acceptance_by_position"] == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert s["tau_histogram"] == {4: 1, 2: 1, 1: 1}
    assert s["tokens_per_s"] == pytest.approx(10.0)
    assert s["speedup"] == pytest.approx(10.0 / 5.0)
    t = s["time"]
    assert (t["draft_s"], t["verify_s"], t["other_s"]) == pytest.approx((0.2, 0.3, 0.1))
    assert t["fractions"]["draft"] == pytest.approx(0.2 / 0.7)
    # EESD App. D (docs/methods/eesd.md §6): v_d = accepted / drafted = 4/9, r_d = accepted / output tokens = 4/7.
    # (This test used to assert v_d = 0.9, a drafting-speed ratio that was a guess, not the paper's v_d.)
    assert s["v_d"] == pytest.approx(4 / 9) and s["r_d"] == pytest.approx(4 / 7)
    assert s["hm"] == pytest.approx(2 * (4 / 9) * (4 / 7) / (4 / 9 + 4 / 7))
    # α = T_d / T_t: draft 0.2/9 s per drafted token over AR 0.2 s per token = 1/9
    assert s["alpha"] == pytest.approx(1 / 9)
    # AR's prefill is not a decoding step: 0.35 of its 1.4 s prefilling leaves 0.15 s per token, α = (0.2/9) / 0.15
    ar = ar_stats()
    ar.prefill_time_s = 0.35
    assert metrics.summarize([rec("chain", chain_stats())], [rec("ar", ar)])["alpha"] == pytest.approx(0.2 / 9 / 0.15)
    assert s["mean_draft_length"] == pytest.approx(3.0) and s["drafting_rounds"] == 3


def ragged_stats():
    # prompt a: rounds drafted 4, 4, then a last round with one token left that drafts nothing (0 of 0);
    # prompt b: drafted 2, 3, 0, accepted 2, 1, 0. Emitted (a + 1 per round): a 3+1+1 = 5, b 3+2+1 = 6.
    a = DecodeStats(new_tokens=5, target_forwards=3, accepted_per_round=[2, 0, 0], drafted_per_round=[4, 4, 0],
                    draft_time_s=0.1, total_time_s=0.5)
    b = DecodeStats(new_tokens=6, target_forwards=3, accepted_per_round=[2, 1, 0], drafted_per_round=[2, 3, 0],
                    draft_time_s=0.1, total_time_s=0.5)
    return a, b


def test_tau_no_bonus_skips_rounds_that_drafted_nothing():
    a, b = ragged_stats()
    assert a.tau_no_bonus == pytest.approx(2 / 2)  # not 2/3: the empty last round could accept nothing
    assert b.tau_no_bonus == pytest.approx(3 / 2)
    assert DecodeStats(accepted_per_round=[0, 0], drafted_per_round=[0, 0]).tau_no_bonus == 0.0  # AR
    assert DecodeStats(accepted_per_round=[1, 3]).tau_no_bonus == pytest.approx(2.0)  # drafted unknown: counted
    s = metrics.summarize([rec("chain", a, pid="a"), rec("chain", b, pid="b")])
    assert s["tau_no_bonus"] == pytest.approx(5 / 4) and s["drafting_rounds"] == 4
    assert s["mean_draft_length"] == pytest.approx(13 / 4)  # drafted tokens per round that drafted
    assert s["gamma_total"] == 13 and s["tau"] == pytest.approx(11 / 6)
    assert s["tau_histogram"] == {3: 2, 1: 3, 2: 1}  # every target forward, the empty rounds included


def test_eesd_metrics_by_hand():
    a, b = ragged_stats()
    s = metrics.summarize([rec("chain", a, pid="a"), rec("chain", b, pid="b")])
    v_d, r_d = 5 / 13, 5 / 11  # accepted / drafted (Eq. 11); accepted / output tokens (Eq. 12)
    assert s["v_d"] == pytest.approx(v_d) and s["r_d"] == pytest.approx(r_d)
    assert s["acceptance_rate"] == pytest.approx(v_d)
    assert s["hm"] == pytest.approx(2 * v_d * r_d / (v_d + r_d)) == pytest.approx(100 / 240)
    assert s["speedup"] is None and s["alpha"] is None  # no AR records given
    ar = metrics.summarize([rec("ar", ar_stats())])
    assert ar["v_d"] is None and ar["r_d"] is None and ar["hm"] is None and ar["mean_draft_length"] is None
    # the paper's own example (13B Gsm8k, Cali-TS): v_d 0.52, r_d 0.69 → HM ≈ 59 % (Table 1 prints 58.97)
    assert metrics.eesd_hm(0.52, 0.69) == pytest.approx(0.593, abs=1e-3)


def test_speedup_spread_pairs_repeats():
    fast = [rec("chain", DecodeStats(new_tokens=10, target_forwards=5, total_time_s=t), repeat=i)
            for i, t in enumerate([1.0, 0.5, 2.0])]  # 10, 20, 5 tok/s
    ar = [rec("ar", ar_stats(10, t), repeat=i) for i, t in enumerate([2.0, 2.5, 4.0])]  # 5, 4, 2.5 tok/s
    s = metrics.summarize(fast, ar)
    assert s["speedup_by_repeat"] == pytest.approx([2.0, 5.0, 2.0])
    assert s["speedup_spread"] == pytest.approx({"min": 2.0, "median": 2.0, "max": 5.0})


def test_speedup_is_ratio_of_medians_over_repeats():
    fast = [rec("chain", DecodeStats(new_tokens=10, target_forwards=5, total_time_s=t), repeat=i)
            for i, t in enumerate([1.0, 0.5, 2.0])]  # 10, 20, 5 tok/s → median 10
    ar = [rec("ar", ar_stats(10, t), repeat=i) for i, t in enumerate([2.0, 2.5, 4.0])]  # 5, 4, 2.5 → median 4
    s = metrics.summarize(fast, ar)
    assert s["tokens_per_s_spread"] == {"min": 5.0, "median": 10.0, "max": 20.0}
    assert s["speedup"] == pytest.approx(10.0 / 4.0)


def test_tokens_per_s_pools_prompts_within_a_repeat():
    recs = [rec("ar", ar_stats(10, 1.0), pid="a"), rec("ar", ar_stats(30, 1.0), pid="b")]
    assert metrics.tokens_per_s_by_repeat(recs) == [20.0]  # (10 + 30) / 2 s, not mean of 10 and 30


def test_acceptance_by_position_handles_ragged_depths():
    a = DecodeStats(accept_by_position=[1], proposed_by_position=[2])
    b = DecodeStats(accept_by_position=[2, 1, 0], proposed_by_position=[2, 2, 1])
    assert metrics.acceptance_by_position([a, b]) == pytest.approx([3 / 4, 1 / 2, 0.0])


def test_eesd_hm_formula():
    assert metrics.eesd_hm(0.5, 0.5) == pytest.approx(0.5)
    assert metrics.eesd_hm(1.0, 0.25) == pytest.approx(0.4)
    assert metrics.eesd_hm(None, 0.3) is None and metrics.eesd_hm(0.0, 0.0) is None


def test_first_divergence():
    assert selfcheck.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert selfcheck.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert selfcheck.first_divergence([1, 2], [1, 2, 9]) == 2


class FixedLogitsModel(torch.nn.Module):
    """The model's own forward (the self-check's independent reference): logits_V at every position, plus
    `step_jitter` on token 9 in a step fed with a cache (another summation order, as a real model's)."""

    def __init__(self, logits_V, step_jitter=0.0, dtype=torch.float32):
        super().__init__()
        self.w = torch.nn.Parameter(torch.zeros(1, dtype=dtype))
        self.logits_V, self.step_jitter = logits_V, step_jitter

    @property
    def device(self):
        return self.w.device

    def forward(self, input_ids, cache=None, use_cache=False, logits_to_keep=0):
        logits = self.logits_V.clone().expand(1, logits_to_keep or input_ids.shape[1], -1).clone()
        if cache is not None:
            logits[..., 9] += self.step_jitter
        return SimpleNamespace(logits=logits, cache="cache" if use_cache else None)


class FixedLogitsTarget:
    """Every verification row gets logits_V (+ `offset` everywhere), plus `jitter` on token 9 when more than one row
    is verified; its model's own forward gives logits_V (+ `step_jitter` on token 9 in a cached step)."""

    device = "cpu"

    def __init__(self, logits_V, jitter=0.0, step_jitter=0.0, offset=0.0, dtype=torch.float32):
        self.logits_V, self.jitter, self.offset, self.calls = logits_V, jitter, offset, []
        self.model = FixedLogitsModel(logits_V, step_jitter, dtype)

    def prefill(self, seq):
        self.calls.append(("prefill", list(seq)))

    def verify(self, last, tree):
        rows = torch.stack([self.logits_V.clone() + self.offset for _ in range(1 + len(tree))])
        if len(tree):
            rows[:, 9] += self.jitter
        return rows

    def commit(self, path):
        pass


def test_self_check_counts_prompts_identical_in_every_repeat():
    ar = [rec("ar", DecodeStats(), pid=p, tokens=t) for p, t in [("a", [1, 2]), ("b", [3, 4]), ("c", [5, 6])]]
    method = [
        rec("chain", DecodeStats(), 0, "a", [1, 2]), rec("chain", DecodeStats(), 1, "a", [1, 2]),
        rec("chain", DecodeStats(), 0, "b", [3, 4]), rec("chain", DecodeStats(), 1, "b", [3, 9]),  # repeat 1 differs
        rec("chain", DecodeStats(), 0, "c", [5, 7]), rec("chain", DecodeStats(), 1, "c", [5, 7]),
    ]
    ids = {"a": [0], "b": [0], "c": [0]}
    logits = torch.zeros(10)  # token 4 and 9 tie exactly, 6 is far above 7
    logits[4] = logits[9] = 2.0
    logits[6] = 5.0
    sc = selfcheck.self_check(method, ar, ids, FixedLogitsTarget(logits), check_ar_tokens=False)
    assert (sc["identical"], sc["total"]) == (1, 3)
    assert sorted(sc["mismatched_prompts"]) == ["b", "c"]
    assert (sc["near_ties"], sc["defects"]) == (1, 1)  # b: 4 vs 9 tie; c: 6 vs 7 is a real difference
    by_prompt = {d["prompt_id"]: d for d in sc["divergences"]}
    assert by_prompt["b"]["position"] == 1 and by_prompt["b"]["repeat"] == 1
    assert by_prompt["c"]["gap"] == pytest.approx(5.0) and by_prompt["c"]["top2_margin"] == pytest.approx(3.0)


def test_every_repeat_of_ar_is_checked_against_the_models_own_forward():
    """Only AR's first repeat was checked: a later repeat whose output is not the model's greedy one (here token 7
    where the forward's argmax is 6 by a wide margin) passed, as long as every method agreed with repeat 0."""
    logits = torch.zeros(10)
    logits[6] = 5.0
    ar = [rec("ar", DecodeStats(), 0, "a", [6, 6]), rec("ar", DecodeStats(), 1, "a", [6, 7])]
    method = [rec("chain", DecodeStats(), r, "a", [6, 6]) for r in (0, 1)]
    sc = selfcheck.self_check(method, ar, {"a": [0]}, FixedLogitsTarget(logits))
    assert (sc["identical"], sc["total"]) == (1, 1)
    assert (sc["ar_defects"], sc["defects"]) == (1, 1)
    assert [(d["repeat"], d["position"]) for d in sc["ar_divergences"]] == [(1, 1)]


def test_near_tie_is_judged_against_the_noise_of_the_models_own_forward():
    """A bf16 model (one rounding step at 2.0 is 2 * 2**-7 * 2 = 0.03, the ceiling 8 steps at max |r| = 2 is 0.25):
    a gap of 0.1 is a near-tie when the model's own one-shot and cached-step logits differ by 0.1, a defect when
    they agree, however much the harness's own one-row and multi-row logits differ (the code under test sets no
    tolerance)."""
    logits = torch.zeros(10)
    logits[4], logits[9] = 2.0, 1.9
    ar = [rec("ar", DecodeStats(), pid="a", tokens=[4])]
    spec = [rec("chain", DecodeStats(drafted_per_round=[3]), pid="a", tokens=[9])]
    ids = {"a": [0, 1, 2, 3]}

    def check(**fake):
        return selfcheck.self_check(spec, ar, ids, FixedLogitsTarget(logits, dtype=torch.bfloat16, **fake),
                                    check_ar_tokens=False)

    noisy, exact, harness_noisy = check(step_jitter=0.1), check(), check(jitter=0.1)
    assert noisy["divergences"][0]["noise"] == pytest.approx(0.1) and noisy["near_ties"] == 1
    assert noisy["divergences"][0]["tolerance"] == pytest.approx(0.2)
    assert exact["divergences"][0]["noise"] == 0.0 and exact["defects"] == 1
    assert exact["divergences"][0]["tolerance"] == pytest.approx(2 * 2**-7 * 2.0)  # the floor: one step at r(a)
    assert harness_noisy["divergences"][0]["noise"] == 0.0 and harness_noisy["defects"] == 1
    assert harness_noisy["divergences"][0]["harness_deviation"] == pytest.approx(0.1)
    assert noisy["divergences"][0]["rows_probed"] == [1, 2, 4]  # bulk prefill + 1 row, 2, the method's 1 + 3 drafts


def test_a_harness_whose_logits_leave_the_reference_beyond_the_ceiling_is_a_defect_even_on_a_tie():
    """Tokens 4 and 9 tie exactly in the reference, but the harness's logits there are 3.0 off it: more than
    CEILING_STEPS rounding steps of fp32 at the logits' scale can explain, so the flip is a defect."""
    logits = torch.zeros(10)
    logits[4] = logits[9] = 2.0
    ar = [rec("ar", DecodeStats(), pid="a", tokens=[4])]
    spec = [rec("chain", DecodeStats(drafted_per_round=[3]), pid="a", tokens=[9])]
    ids = {"a": [0, 1, 2]}
    fine = selfcheck.self_check(spec, ar, ids, FixedLogitsTarget(logits), check_ar_tokens=False)
    off = selfcheck.self_check(spec, ar, ids, FixedLogitsTarget(logits, offset=3.0), check_ar_tokens=False)
    assert fine["near_ties"] == 1 and fine["divergences"][0]["gap"] == 0.0
    d = off["divergences"][0]
    assert off["defects"] == 1 and d["gap"] == 0.0 and d["harness_deviation"] == pytest.approx(3.0)
    eps = 2.0 ** -10  # float16's epsilon: float32 counts in float16's steps
    assert d["ceiling"] == pytest.approx(8 * 2 * eps * 2.0)  # by hand: 8 steps (the documented ceiling), max |r| = 2
    just_over = selfcheck.self_check(spec, ar, ids, FixedLogitsTarget(logits, offset=0.04), check_ar_tokens=False)
    assert just_over["defects"] == 1  # 0.04 is past 8 steps at |r| = 2 (0.03125): a looser ceiling would pass it


def test_a_missing_token_is_a_defect_and_no_target_means_unchecked():
    ar = [rec("ar", DecodeStats(), pid="a", tokens=[1, 2])]
    short = [rec("chain", DecodeStats(), pid="a", tokens=[1])]
    assert selfcheck.self_check(short, ar, {"a": [0]}, FixedLogitsTarget(torch.zeros(10)),
                                check_ar_tokens=False)["defects"] == 1
    unchecked = selfcheck.self_check(short, ar, {"a": [0]})
    assert unchecked["divergences"][0]["verdict"] == "unchecked" and not unchecked["near_tie_checked"]


def test_ar_is_checked_past_its_first_near_tie():
    """Tokens 4 and 9 tie exactly at every position, 7 is 2.0 below them. AR (and a method agreeing with it) emits
    9 then 7: the first is a tie flip, the second no rounding explains. check_ar stopped at the first difference,
    so a harness that computed both wrongly passed as identical with 0 defects."""
    logits = torch.zeros(10)
    logits[4] = logits[9] = 2.0
    ar = [rec("ar", DecodeStats(), pid="a", tokens=[9, 7])]
    same = [rec("chain", DecodeStats(drafted_per_round=[3]), pid="a", tokens=[9, 7])]
    sc = selfcheck.self_check(same, ar, {"a": [0, 1, 2]}, FixedLogitsTarget(logits, dtype=torch.bfloat16))
    assert (sc["identical"], sc["ar_defects"], sc["defects"]) == (1, 1, 1)
    d = sc["ar_divergences"][0]
    assert d["position"] == 0 and [(x["position"], x["verdict"]) for x in d["later"]] == [(1, "defect")]
    selfcheck._AR_CHECKED.clear()
    tie_only = [rec("ar", DecodeStats(), pid="a", tokens=[9, 4])]  # a flip, then the forward's own pick: fine
    sc = selfcheck.self_check([rec("chain", DecodeStats(), pid="a", tokens=[9, 4])], tie_only, {"a": [0, 1, 2]},
                              FixedLogitsTarget(logits, dtype=torch.bfloat16))
    assert (sc["ar_near_ties"], sc["defects"]) == (1, 0)


def test_an_output_that_stops_short_after_a_near_tie_is_a_defect():
    """After a tie flip only the method's own tokens were checked, so an output cut short (no EOS, fewer tokens than
    its budget) passed as a near-tie. It must end at an EOS or at its budget: max_new_tokens where given, else
    AR's length where AR did not stop at an EOS."""
    logits = torch.zeros(10)
    logits[4] = logits[9] = 2.0
    ar = [rec("ar", DecodeStats(), pid="a", tokens=[4] * 6)]
    ids = {"a": [0, 1, 2]}

    def verdict(tokens, **kw):
        method = [rec("chain", DecodeStats(drafted_per_round=[3]), pid="a", tokens=tokens)]
        sc = selfcheck.self_check(method, ar, ids, FixedLogitsTarget(logits, dtype=torch.bfloat16),
                                  check_ar_tokens=False, **kw)
        return sc["divergences"][0]["verdict"]

    assert verdict([9]) == "defect"  # 1 token where AR's 6 (no EOS) say the budget is 6
    assert verdict([9] + [4] * 5) == "near_tie"  # the flip, then the whole budget
    assert verdict([9, 4], eos_token_id=[4]) == "near_tie"  # ends at an EOS: a decode may stop there
    assert verdict([9] + [4] * 5, max_new_tokens=8) == "defect"  # the run's budget was 8 (AR's 6 is not it)
    # AR itself stopping short of a given budget is a defect too
    sc = selfcheck.self_check([rec("chain", DecodeStats(), pid="a", tokens=[4] * 6)], ar, ids,
                              FixedLogitsTarget(logits, dtype=torch.bfloat16), max_new_tokens=8)
    assert sc["ar_defects"] == 1 and sc["ar_divergences"][0]["stopped_early"]


@pytest.mark.parametrize("sampler", [False, True])  # kernel high-water mark, and the sampling fallback
def test_pass_memory_on_cpu_is_rss_at_start_and_the_pass_peak_above_it(sampler):
    import psutil

    with metrics.PassMemory("cpu", sampler=sampler) as mem:
        block = torch.ones(64 * 2**20 // 4)  # 64 MiB touched, then freed inside the pass
        if sampler:
            import time

            time.sleep(0.05)  # the sampler reads every 5 ms
        del block
    m = mem.result
    assert m["kind"] == "cpu_rss" and ("sampled" in m["how"]) == sampler
    assert m["start_bytes"] >= psutil.Process().memory_info().rss * 0.5  # start ≈ (roughly) current RSS
    assert m["peak_bytes"] == m["start_bytes"] + m["bytes"]
    assert 60 * 2**20 <= m["bytes"] < 80 * 2**20  # the freed block still counts: a peak, not an end value


def test_step_slope_sees_a_steady_leak_but_not_one_heap_jump():
    xs = [0, 10, 20, 30, 40, 50]
    assert metrics.step_slope(xs, [100, 100, 100, 2800, 2800, 2800]) == 0  # one arena added between 20 and 30
    assert metrics.step_slope(xs, [100 + 280 * x / 10 for x in xs]) == pytest.approx(28.0)  # 28 bytes a prompt
    assert metrics.step_slope([1], [3]) is None


def test_record_to_dict_has_raw_and_derived_fields():
    d = rec("chain", chain_stats()).to_dict()
    assert d["stats"]["accepted_per_round"] == [3, 1, 0]
    assert d["stats"]["tau"] == pytest.approx(7 / 3) and d["stats"]["tokens_per_s"] == pytest.approx(10.0)
    assert d["tokens"] == [1, 2, 3] and d["prompt_len"] == 4
