"""benchmarks.decoding.context_curves regroups a long-context eval's records by length: each figure equals a hand
computation from the records, both task groups of a length pooled in "all"."""

from __future__ import annotations

import json
from dataclasses import asdict

import pytest

from benchmarks.decoding import context_curves
from draftforge.decode.base import DecodeStats

MIB = 2**20


def record(method, pid, tokens, total, prefill, forwards, kv, state=None):
    stats = DecodeStats(new_tokens=tokens, target_forwards=forwards, accepted_per_round=[0] * forwards,
                        drafted_per_round=[0 if method == "ar" else 3] * forwards, prefill_time_s=prefill,
                        total_time_s=total, target_cache_bytes=kv, drafter_state_bytes=state)
    return {"method": method, "temperature": 0.0, "repeat": 0, "prompt_id": pid, "turn": 0, "prompt_len": 1000,
            "tokens": [1] * tokens, "stats": asdict(stats)}


@pytest.fixture
def report_dir(tmp_path):
    prompts = [{"prompt_id": p, "category": c} for p, c in
               (("s1", "single-doc@1k"), ("m1", "multi-doc@1k"), ("s8", "single-doc@8k"), ("x", "other"))]
    records = [
        # 1k: AR 10 tokens in 1.5 s each (0.5 prefill) -> decoding 20 tokens / 2.0 s; chain 10 in 1.0 (0.5)
        record("ar", "s1", 10, 1.5, 0.5, 10, 20 * MIB), record("ar", "m1", 10, 1.5, 0.5, 10, 22 * MIB),
        record("chain", "s1", 10, 1.0, 0.5, 5, 20 * MIB, MIB), record("chain", "m1", 10, 1.0, 0.5, 5, 22 * MIB, MIB),
        # 8k: AR 10 tokens in 6 s (4 prefill) -> 5 tok/s decoding; chain 10 in 5 s (4) -> 10 tok/s
        record("ar", "s8", 10, 6.0, 4.0, 10, 176 * MIB), record("chain", "s8", 10, 5.0, 4.0, 4, 176 * MIB, MIB),
        record("ar", "x", 10, 1.0, 0.0, 10, 1), record("chain", "x", 10, 0.1, 0.0, 1, 1, 1),  # no length: left out
    ]
    (tmp_path / "run").mkdir()
    results = [{"method": "chain", "temperature": 0.0, "cost_model": {"by_length": {  # as JSON keeps it: str keys
        "8192": {"best_chain_length": 1, "shorter_chains": {"1": 1.3, "2": 1.1}}}}}]
    (tmp_path / "run" / "report.json").write_text(json.dumps(
        {"config": {"drafter": "d"}, "prompts": prompts, "records": records, "results": results}))
    return tmp_path / "run"


def test_rows_per_length_are_the_hand_computed_figures(report_dir, tmp_path, capsys):
    result = context_curves.main([str(report_dir), "--label", "run=mine", "--out", str(tmp_path / "out"),
                                  "--no-plot"])
    rows = {(r["method"], r["group"], r["length_k"]): r for r in result["rows"]}
    one = rows[("chain", "all", 1)]
    assert one["run"] == "mine" and one["prompts"] == 2
    assert one["tau"] == pytest.approx(20 / 10)
    assert one["speedup"] == pytest.approx((20 / 2.0) / (20 / 3.0))
    assert one["decode_speedup"] == pytest.approx((20 / 1.0) / (20 / 2.0))
    eight = rows[("chain", "all", 8)]
    assert eight["decode_speedup"] == pytest.approx(2.0) and eight["speedup"] == pytest.approx(6.0 / 5.0)
    assert eight["drafter_state_mib"] == pytest.approx(1.0) and rows[("ar", "all", 8)]["target_kv_mib"] == 176
    assert eight["best_chain_length"] == 1 and eight["best_chain_predicted_speedup"] == 1.3  # the cost model at 8k
    assert one["best_chain_length"] is None and rows[("ar", "all", 8)]["best_chain_length"] is None
    assert rows[("ar", "all", 1)]["target_kv_mib"] == pytest.approx(21.0)  # the median of 20 and 22
    assert rows[("chain", "single-doc", 1)]["prompts"] == 1 and ("chain", "multi-doc", 8) not in rows
    assert not any(r["length_k"] is None for r in result["rows"])  # "other" has no length: not a row
    assert "mine" in capsys.readouterr().out
    assert json.loads((tmp_path / "out" / "context_curves.json").read_text())["rows"] == result["rows"]


def test_a_report_without_lengths_is_refused(tmp_path):
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "report.json").write_text(json.dumps(
        {"config": {}, "prompts": [{"prompt_id": "a", "category": "qa"}], "records": []}))
    with pytest.raises(SystemExit, match="not a long-context question set"):
        context_curves.main([str(tmp_path / "r"), "--out", str(tmp_path / "o"), "--no-plot"])
    with pytest.raises(SystemExit, match="no report.json"):
        context_curves.main([str(tmp_path / "missing"), "--out", str(tmp_path / "o"), "--no-plot"])


def test_the_plot_is_written(report_dir, tmp_path):
    context_curves.main([str(report_dir), "--out", str(tmp_path / "out")])
    assert (tmp_path / "out" / "context_curves.png").stat().st_size > 1000
