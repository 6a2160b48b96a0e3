"""Per-category costs for long-context buckets (metrics.round_costs, report.category_cost_markdown): each figure
equals a hand computation from the decode stats, and the report shows them per category."""

from __future__ import annotations

import pytest

from draftforge.decode.base import DecodeStats
from draftforge.eval.metrics import RunRecord, by_category, round_costs
from draftforge.eval.report import category_cost_markdown


def stats(forwards, drafted, prefill, draft, verify, total, kv=None, state=None):
    s = DecodeStats(new_tokens=2 * forwards, prefill_time_s=prefill, draft_time_s=draft, verify_time_s=verify,
                    total_time_s=total, target_cache_bytes=kv, drafter_state_bytes=state)
    for _ in range(forwards):
        s.add_round(1 if drafted else 0, drafted, 1 if drafted else 0, "c")
    return s


def record(method, prompt, length, s):
    return RunRecord(method, 0.0, 0, prompt, length, [1] * s.new_tokens, s)


def test_round_costs_are_the_hand_computed_ratios():
    a = stats(forwards=4, drafted=3, prefill=1.0, draft=0.4, verify=2.0, total=3.8)  # other = 0.4
    b = stats(forwards=6, drafted=3, prefill=3.0, draft=0.6, verify=3.0, total=7.2)  # other = 0.6
    costs = round_costs([a, b])
    assert costs["prefill_s_per_prompt"] == pytest.approx((1.0 + 3.0) / 2)
    assert costs["verify_s_per_forward"] == pytest.approx((2.0 + 3.0) / 10)
    assert costs["draft_s_per_round"] == pytest.approx((0.4 + 0.6) / 10)
    assert costs["other_s_per_forward"] == pytest.approx((0.4 + 0.6) / 10)
    ar = stats(forwards=5, drafted=0, prefill=1.0, draft=0.0, verify=2.5, total=3.5)
    assert round_costs([ar])["draft_s_per_round"] is None  # AR drafts nothing


def test_each_bucket_gets_its_costs_and_context_length_in_the_report():
    mib = 2**20
    chain = [record("chain", "s1k", 1000, stats(4, 3, 1.0, 0.4, 2.0, 3.8, 22 * mib, mib // 2)),
             record("chain", "s8k", 8000, stats(4, 3, 8.0, 0.4, 4.0, 12.8, 176 * mib, mib // 2))]
    ar = [record("ar", "s1k", 1000, stats(8, 0, 1.0, 0.0, 3.2, 4.2, 22 * mib)),
          record("ar", "s8k", 8000, stats(8, 0, 8.0, 0.0, 6.4, 14.8, 176 * mib))]  # 0.4 s neither prefill nor verify
    cats = {"s1k": "single-doc@1k", "s8k": "single-doc@8k"}
    chain_cats, ar_cats = by_category(chain, ar, cats), by_category(ar, ar, cats)
    assert chain_cats["single-doc@8k"]["per_round"]["verify_s_per_forward"] == pytest.approx(1.0)
    assert chain_cats["single-doc@8k"]["prompt_tokens"]["median"] == 8000
    assert ar_cats["single-doc@1k"]["per_round"]["other_s_per_forward"] == pytest.approx(0.0)
    report = {"results": [{"method": "ar", "temperature": 0.0, "by_category": ar_cats},
                          {"method": "chain", "temperature": 0.0, "by_category": chain_cats}]}
    table = category_cost_markdown(report)
    # ar 8k: verify 6.4 s / 8 forwards, harness (14.8 - 8.0 - 6.4) s / 8; chain 8k: draft 0.4 s / 4 rounds,
    # verify 4.0 s / 4, harness (12.8 - 8.0 - 0.4 - 4.0) s / 4; AR's column shows the target's KV, chain's the
    # drafter's state
    assert "| single-doc@8k | 8000 | 8.00 | 800.0 | 50.0 | 176.0 | 100.0 | 1000.0 | 100.0 | 0.5 |" in table, table
    assert "| single-doc@1k | 1000 | 1.00 | 400.0 | 0.0 | 22.0 | 100.0 | 500.0 | 100.0 | 0.5 |" in table, table


def test_a_method_that_does_not_time_its_prefill_gets_no_decoding_speedup():
    """transformers' assisted generation prefills inside its own generate() (prefill_time_s stays 0): its
    decoding-only figures would count the prefill its AR peer leaves out, so there are none; end to end stays."""
    from draftforge.eval.metrics import summarize

    ar = [record("ar", "p", 8000, stats(4, 0, 3.0, 0.0, 1.0, 4.0))]  # 8 tokens: 4 s end to end, 1 s decoding
    hf = [record("hf_assisted", "p", 8000, stats(4, 3, 0.0, 0.2, 3.3, 3.5))]  # 8 tokens; its prefill inside its 3.3 s
    got = summarize(hf, ar)
    assert got["decode_tokens_per_s"] is None and got["decode_speedup"] is None
    assert got["speedup"] == pytest.approx(4.0 / 3.5)
    assert summarize(ar, ar)["decode_speedup"] == pytest.approx(1.0)
