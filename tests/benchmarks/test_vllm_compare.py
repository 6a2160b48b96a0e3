"""benchmarks/serving: the vLLM comparison skips with its reason where no vLLM environment exists (CI never needs
vLLM), and vLLM's settings are read as documented."""

from __future__ import annotations

import json

import pytest

from benchmarks.serving import vllm_compare
from benchmarks.serving.vllm_serve import parse_setting


def test_no_vllm_environment_is_a_skip_with_its_reason(tmp_path):
    out = tmp_path / "v.json"
    result = vllm_compare.main(["--target", "t", "--vllm-python", str(tmp_path / "none" / "python"), "--out", str(out)])
    assert result["skipped"].startswith(f"no vLLM environment at {tmp_path / 'none' / 'python'}")
    assert json.loads(out.read_text()) == result


def test_settings():
    assert parse_setting("plain") == ("plain", None)
    assert parse_setting("ngram:3")[1]["num_speculative_tokens"] == 3
    assert parse_setting("draft:/d:4") == ("draft-4", {"model": "/d", "num_speculative_tokens": 4})
    with pytest.raises(SystemExit, match="give plain, ngram:K, draft:DIR:K or mamba:DIR:K"):
        parse_setting("eagle")


def test_a_mamba_drafter_goes_through_the_custom_class_proposer(monkeypatch):
    monkeypatch.delenv("DRAFTFORGE_MAMBA_DRAFTER", raising=False)
    name, spec = parse_setting("mamba:/exports/m2:3")
    assert name == "mamba-3" and spec["method"] == "custom_class" and spec["num_speculative_tokens"] == 3
    assert spec["model"] == "benchmarks.serving.mamba_proposer.MambaProposer"
    import os

    assert os.environ["DRAFTFORGE_MAMBA_DRAFTER"] == "/exports/m2"
    monkeypatch.delenv("DRAFTFORGE_MAMBA_DRAFTER")


def test_the_mamba_proposer_drafts_what_the_drafter_would_greedily(tmp_path, monkeypatch):
    """The proposer's chain for a row = the drafter's own greedy continuation of that row's committed tokens."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from benchmarks.serving.mamba_proposer import MambaProposer
    from tests.fixtures.decode import tiny_mamba2

    model = tiny_mamba2(vocab=64)
    model.generation_config.eos_token_id = None
    model.save_pretrained(tmp_path / "m")
    monkeypatch.setenv("DRAFTFORGE_MAMBA_DRAFTER", str(tmp_path / "m"))
    proposer = MambaProposer(SimpleNamespace(speculative_config=SimpleNamespace(num_speculative_tokens=4)))
    rows = np.zeros((2, 16), dtype=np.int64)
    rows[0, :5], rows[1, :3] = [5, 17, 42, 9, 3], [7, 7, 1]
    drafts = proposer.propose([[3], [1]], np.array([5, 3]), rows)
    for seq, got in (([5, 17, 42, 9, 3], drafts[0]), ([7, 7, 1], drafts[1])):
        x = torch.tensor([seq])
        want = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=4, do_sample=False)
        assert got == want[0, len(seq):].tolist()
    assert proposer.propose([[], [2]], np.array([5, 3]), rows)[0] == []  # a row that sampled nothing drafts nothing
