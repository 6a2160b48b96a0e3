"""benchmarks/micro/eagle3_step.py on a tiny Llama target: both precisions run, every part is timed, and the
reference form (every anchor's logits, the teacher per step, whole-batch terms) and draftforge's (the kept rows'
logits, the teacher once per batch, chunked terms) give the same loss bitwise, the terms really in several chunks."""

from __future__ import annotations

import json

import pytest

from benchmarks.micro import eagle3_step
from draftforge.train import divergences
from tests.fixtures.decode import tiny_llama


@pytest.mark.parametrize("body", ["attention", "mamba2"])
def test_eagle3_step_times_every_part_and_the_two_loss_forms_agree(tmp_path, monkeypatch, capsys, body):
    tiny_llama(vocab=96, layers=4, hidden=64, ctx=64).save_pretrained(tmp_path / "t")
    monkeypatch.setattr(divergences, "CHUNK_BYTES", 4 * 40 * 7)  # 7 positions a chunk over the 40-id head
    out = tmp_path / "e3.json"
    rc = eagle3_step.main(["--target", str(tmp_path / "t"), "--batch", "2", "--block", "24", "--ttt-steps", "3",
                           "--draft-vocab", "40", "--prompt", "5", "--repeats", "2", "--body", body, "--out", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert [r["precision"] for r in result["results"]] == ["bf16", "fp32"] and result["body"] == body
    for r in result["results"]:
        assert set(r["ms"]) == {"target forward", "head + loss + backward: draftforge",
                                "head + loss + backward: before"}
        assert all(v > 0 for v in r["ms"].values()) and len(r["ms_all"]["target forward"]) == 3  # warm-up + 2
        assert r["losses"]["draftforge"] == r["losses"]["before"] and r["same_logits"] is True
    assert "the same loss bitwise in every precision" in capsys.readouterr().out
