"""benchmarks/micro/verify_context.py on a tiny bf16 Llama: every variant loads with the attention its name says
(transformers' sdpa, the matmul path only, the probe's choice), every row count is timed at every context, and a
context the target cannot hold is refused."""

from __future__ import annotations

import os

import pytest
import torch

from benchmarks.micro import verify_context
from draftforge.decode.attention import FLASH_ROWS_ENV
from tests.fixtures.decode import tiny_llama


def test_verify_context_times_every_variant_and_row_count(tmp_path, capsys):
    tiny_llama(vocab=64, layers=2, hidden=64, ctx=256, dtype=torch.bfloat16).save_pretrained(tmp_path / "t")
    out = tmp_path / "vc.json"
    before = os.environ.get(FLASH_ROWS_ENV)
    result = verify_context.main(["--target", str(tmp_path / "t"), "--contexts", "20", "60", "--rows", "1", "3",
                                  "--calls", "1", "--repeats", "1", "--dtype", "bfloat16", "--out", str(out)])
    assert os.environ.get(FLASH_ROWS_ENV) == before  # the matmul variant's setting does not leak
    assert out.is_file() and set(result["contexts"]) == {"20", "60"}
    attention = result["attention"]
    assert attention["sdpa"].startswith("attention left as it is")
    assert "flash kernel" not in attention["matmul"] and f"set by {FLASH_ROWS_ENV}" in attention["matmul"]
    assert "probed at" in attention["probed"]
    for ctx in result["contexts"].values():
        assert set(ctx["ms"]) == {"sdpa", "matmul", "probed"}
        assert all(ms > 0 for per in ctx["ms"].values() for ms in per.values())
        assert all(len(v) == 1 for per in ctx["samples"].values() for v in per.values())
    assert "N = 3" in capsys.readouterr().out


def test_verify_context_refuses_a_context_past_the_targets(tmp_path, capsys):
    tiny_llama(vocab=64, ctx=64, dtype=torch.bfloat16).save_pretrained(tmp_path / "t")
    with pytest.raises(SystemExit):
        verify_context.main(["--target", str(tmp_path / "t"), "--contexts", "50", "--rows", "1", "6",
                             "--out", str(tmp_path / "x.json")])
    assert "exceeds the target's" in capsys.readouterr().err
