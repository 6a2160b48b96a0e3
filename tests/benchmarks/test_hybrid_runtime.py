"""benchmarks/decoding/hybrid_runtime.py: STree's t(N) fit recovers a known quadratic, times trees of every form on a
hybrid target, and puts the predicted speedups next to an eval report's measured ones."""

from __future__ import annotations

import json

import pytest

from benchmarks.decoding import hybrid_runtime
from tests.fixtures.hybrid import tiny_bamba


def test_fit_recovers_a_known_quadratic():
    ns = list(range(1, 9))
    got = hybrid_runtime.fit(ns, [2e-4 * n * n + 3e-3 * n + 0.04 for n in ns])
    assert (got["a"], got["b"], got["c"]) == pytest.approx((2e-4, 3e-3, 0.04), rel=1e-6)


def test_prediction_is_tau_times_t1_over_t_of_rows():
    model = {"a": 0.0, "b": 0.01, "c": 0.05}  # t(1) = 0.06, t(5) = 0.10
    report = {"results": [{"method": "chain", "temperature": 0, "tau": 2.0, "speedup": 1.1, "decode_speedup": 1.2,
                           "target_forwards": 10, "time": {"draft_s": 0.2}, "verify_cost": {"tokens_per_verify": 5.0}}]}
    (row,) = hybrid_runtime.predict(report, model)
    # the prediction prices decoding steps: set next to the decoding-only figure, end to end given too
    assert (row["measured_decode_speedup"], row["measured_speedup"]) == (1.2, 1.1)
    assert row["predicted_speedup_verify_only"] == pytest.approx(2.0 * 0.06 / 0.10)
    assert row["predicted_speedup_with_draft"] == pytest.approx(2.0 * 0.06 / (0.10 + 0.02))
    (row,) = hybrid_runtime.predict(report, model, t1=0.05)  # a measured one-row time replaces the fit's t(1)
    assert row["predicted_speedup_verify_only"] == pytest.approx(2.0 * 0.05 / 0.10)


def test_runs_on_a_hybrid_target_with_a_parent_list_tree(tmp_path, capsys):
    target = tmp_path / "bamba"
    tiny_bamba(vocab=64).save_pretrained(target)
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"results": [{"method": "ar", "temperature": 0, "tau": 1.0, "speedup": 1.0,
                                               "target_forwards": 8, "time": {"draft_s": 0.0}}]}))
    result = hybrid_runtime.main(["--target", str(target), "--max-n", "4", "--repeats", "1", "--prompt-len", "8",
                                  "--tree", "stree13", "--tree", "6,1", "--report", str(report)])
    assert sorted(result["t_seconds"]) == ["chain1", "chain2", "chain3", "chain4", "tree 6,1", "tree stree13"]
    assert result["trees_vs_model"]["tree stree13"]["rows"] == result["trees_vs_model"]["tree 6,1"]["rows"] == 13
    assert result["prediction"][0]["predicted_speedup_verify_only"] == pytest.approx(1.0)  # AR: τ 1, one row
    assert result["prediction"][0]["report"] == str(report)
    assert "| tree stree13 | 13 |" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        hybrid_runtime.main(["--target", str(target), "--max-n", "3"])
    assert "--max-n must be >= 4" in capsys.readouterr().err
