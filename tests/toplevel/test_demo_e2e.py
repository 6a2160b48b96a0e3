"""End to end: the demo pipeline on its smallest settings (testbed -> target -> drafter -> eval)."""

from __future__ import annotations

import json

import pytest
import torch


@pytest.mark.slow
def test_demo_quick_pipeline(tmp_path):
    from transformers import AutoModelForCausalLM

    from draftforge.demo import run_demo
    from draftforge.export import read_export_metadata

    summary = run_demo(tmp_path / "testbed", tmp_path / "out", quick=True, say=lambda *_: None)
    drafter_dir = summary["drafter_sft"]["export"]
    meta = read_export_metadata(drafter_dir)
    assert meta["task"] == "sft" and meta["target"].endswith("target")
    target = AutoModelForCausalLM.from_pretrained(tmp_path / "testbed" / "quick" / "target")
    drafter = AutoModelForCausalLM.from_pretrained(drafter_dir)
    assert drafter.config.model_type == "mamba2"
    assert drafter.config.vocab_size == target.config.vocab_size
    assert summary["drafter_sft"]["final_loss"] < summary["drafter_pretrain"]["final_loss"]  # SFT data is learnable
    # The SFT rows are the ids the target itself emitted (not re-tokenized text): the first row is the
    # target's greedy continuation of its unmasked prefix, which the oracle (plain generate) reproduces.
    first = json.loads((tmp_path / "out" / "sft_distill.jsonl").read_text().splitlines()[0])
    prompt_len = first["loss_mask"].index(1)
    emitted = [t for t, m in zip(first["input_ids"], first["loss_mask"]) if m]
    again = target.generate(torch.tensor([first["input_ids"][:prompt_len]]), max_new_tokens=16, do_sample=False,
                            pad_token_id=target.config.eos_token_id,
                            eos_token_id=target.config.eos_token_id)[0, prompt_len:].tolist()
    assert emitted == again[: len(emitted)] and len(emitted) in (len(again), 16)
    report = json.loads((tmp_path / "out" / "eval" / "report.json").read_text())
    methods = {r["method"] for r in report["results"]}
    assert {"ar", "chain", "tree"} <= methods
    for r in report["results"]:
        if r["method"] != "ar":  # lossless: greedy speculative output equals plain decoding on every prompt
            sc = r["self_check"]
            assert sc["identical"] == sc["total"] > 0, r
    assert (tmp_path / "out" / "eval" / "report.md").is_file()
    assert (tmp_path / "out" / "eval" / "speedup.png").read_bytes()[:4] == b"\x89PNG"  # the README lists the PNGs
    assert torch.isfinite(torch.tensor(summary["drafter_sft"]["final_loss"]))
    # a second demo into the same --out is accepted before any work: every file there is the first demo's own
    from draftforge.demo import check_out_files

    check_out_files(tmp_path / "out")
