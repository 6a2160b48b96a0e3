"""benchmarks/micro/target_context.py on a tiny bf16 Llama: every variant runs, the bitwise-equal variants decode
the same tokens, and each variant really is what its name says (packed or not, growing cache or not, lean forward
or not; the lean forward's time is counted as the model's forward)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.micro import target_context
from tests.fixtures.decode import tiny_llama


def test_target_context_runs_every_variant(tmp_path, capsys):
    tiny_llama(vocab=64, layers=2, hidden=64, ctx=256).save_pretrained(tmp_path / "t")
    out = tmp_path / "tc.json"
    result = target_context.main(["--target", str(tmp_path / "t"), "--contexts", "24", "80", "--steps", "3",
                                  "--repeats", "1", "--out", str(out)])
    assert out.is_file() and set(result["variants"]) == {"before", "packed", "packed+growing", "after", "lean"}
    for row in result["rows"]:
        assert row["tokens_equal"]
        for name in result["variants"]:
            v = row[name]
            assert v["round_ms"] >= v["forward_ms"] > 0 and v["kv_mb"] > 0
        assert row["before"]["kv_allocated_mb"] == row["before"]["kv_mb"]  # torch.cat: exactly what it holds
        assert row["after"]["kv_allocated_mb"] >= row["after"]["kv_mb"]
    printed = capsys.readouterr().out
    assert "before: linear weights not packed" in printed and "after: linear weights packed" in printed
    assert "draftforge_decode" in printed.split("after:")[1]
    assert "decoding forward: the model's own" in printed.split("after:")[1].split("lean:")[0]
    assert "decoding forward: lean" in printed.split("lean:")[1]


def test_target_context_refuses_a_context_past_the_targets(tmp_path, capsys):
    tiny_llama(vocab=64, ctx=64).save_pretrained(tmp_path / "t")
    with pytest.raises(SystemExit):
        target_context.main(["--target", str(tmp_path / "t"), "--contexts", "60", "--steps", "8",
                             "--out", str(tmp_path / "x.json")])
    assert "context 60 + 10 decoded tokens exceeds the target's 64" in capsys.readouterr().err
