"""benchmarks/decoding/tree_acceptance.py: τ without a clock. A drafter identical to its target has every draft
accepted (p = q, so min(1, p/q) = 1 at any T), so τ is the chain length + 1 and the tree's depth + 1 exactly."""

from __future__ import annotations

import json

import pytest
import torch

from benchmarks.decoding import tree_acceptance
from tests.fixtures.decode import tiny_llama


def test_configs_run_each_tree_with_both_draws_only_above_zero():
    got = [(label, t, draws) for label, _, _, t, draws in tree_acceptance.configs(["stree13"], [0.0, 1.0], 4)]
    assert got == [("chain 4", 0.0, "distinct"), ("tree stree13", 0.0, "distinct"),
                   ("chain 4", 1.0, "distinct"), ("tree stree13", 1.0, "distinct"), ("tree stree13", 1.0, "iid")]


def test_a_drafter_equal_to_its_target_accepts_everything(tmp_path):
    model = tiny_llama(vocab=64, dtype=torch.float64)
    model.save_pretrained(tmp_path / "llama")
    bench = tmp_path / "p.jsonl"
    bench.write_text("".join(json.dumps({"input_ids": ids}) + "\n" for ids in ([5, 17, 42], [3, 8, 12, 61])))
    result = tree_acceptance.main(["--target", str(tmp_path / "llama"), "--drafter", str(tmp_path / "llama"),
                                   "--bench", str(bench), "--tree", "stree13", "--chain-length", "4",
                                   "--max-new-tokens", "10", "--out", str(tmp_path / "out.json")])
    # 10 tokens = two full rounds of 5 (chain 4 + bonus; stree13 is depth 4), per prompt
    assert [(r["config"], r["tau"], r["rounds"]) for r in result["rows"]] == [
        ("chain 4", 5.0, 4), ("tree stree13", 5.0, 4), ("chain 4", 5.0, 4), ("tree stree13", 5.0, 4),
        ("tree stree13", 5.0, 4)]
    assert all(r["tau_minus_chain"] == pytest.approx(0.0) for r in result["rows"])


def test_standard_errors_by_hand():
    assert tree_acceptance.ratio_sem([10, 20], [5, 5]) == pytest.approx(1.0)  # r = 3, residuals ∓5: √(2·50)/10
    a = {"per_prompt": {"emitted": [10, 12], "rounds": [5, 6]}}
    b = {"per_prompt": {"emitted": [8, 9], "rounds": [5, 6]}}
    assert tree_acceptance.paired(a, b) == pytest.approx((0.45, 0.05))  # differences 0.4 and 0.5
