"""`draftforge eval` end to end on tiny random models through the real decoding harness.

Oracle: the target's own `generate(do_sample=False)`; every method's greedy output in the report must equal it.
"""

import argparse
import json
from pathlib import Path

import pytest
import torch

from benchmarks.decoding import spec_decode
from draftforge.errors import CompatibilityError, DataError
from draftforge.eval import command
from draftforge.eval.runner import EvalConfig, run_eval

@pytest.fixture(scope="module")
def models(random_models):
    """(the folder the models are saved in, name -> path)."""
    return Path(random_models["target"]).parent, random_models


def hf_greedy(target_path, prompt_ids, n):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_path).eval()
    out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def write_prompts(path, prompts):
    path.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in prompts))
    return str(path)


PROMPTS = [[5, 17, 42, 9], [3, 88, 12, 61, 7, 30, 2, 99, 14]]


def test_eval_greedy_matches_target_generate(models, tmp_path):
    root, paths = models
    bench = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    rep = run_eval(EvalConfig(target=paths["target"], drafter=paths["transformer_drafter"], bench=bench,
                              max_new_tokens=10, methods=("ar", "chain", "tree"),
                              method_options={"chain": {"chain_length": 3}, "tree": {"tree": (2, 2)}},
                              out_dir=str(tmp_path / "out"), quiet=True, plots=False, dtype="float32"))
    expected = {str(i + 1): hf_greedy(paths["target"], p, 10) for i, p in enumerate(PROMPTS)}
    methods = {r["method"] for r in rep["records"]}
    assert methods == {"ar", "chain", "tree", "hf_assisted"}  # hf_assisted auto-added for a Transformer drafter
    for r in rep["records"]:
        assert r["tokens"] == expected[r["prompt_id"]], (r["method"], r["prompt_id"])
    for row in rep["results"]:
        if row["method"] != "ar":
            assert row["self_check"]["identical"] == row["self_check"]["total"] == 2
            assert row["gamma_total"] > 0
            assert row["mean_draft_length"] > 0 and 0 <= row["v_d"] <= 1 and 0 <= row["r_d"] <= 1
        assert row["tau"] >= 1.0
    hf = rep["manifest"]["hf_assisted_policy"]  # read from the real drafter's generation_config
    assert isinstance(hf["num_assistant_tokens"], int) and hf["num_assistant_tokens"] >= 1
    assert hf["num_assistant_tokens_schedule"] in ("constant", "heuristic", "heuristic_transient")
    assert set(hf["source"]) == {"num_assistant_tokens", "num_assistant_tokens_schedule",
                                 "assistant_confidence_threshold"}
    assert rep["manifest"]["method_order"][0]["order"] == ["ar", "chain", "tree", "hf_assisted"]


def test_eval_rejects_drafter_with_other_vocab(models, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    root, paths = models
    other = tmp_path / "other_vocab"
    LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(other)
    bench = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    with pytest.raises(CompatibilityError, match="vocab sizes differ"):
        run_eval(EvalConfig(target=paths["target"], drafter=str(other), bench=bench, max_new_tokens=4,
                            out_dir=str(tmp_path / "out"), quiet=True, plots=False))


def test_eval_rejects_prompt_longer_than_target_context(models, tmp_path):
    root, paths = models
    bench = write_prompts(tmp_path / "long.jsonl", [list(range(2, 100)) * 5])  # 490 tokens, context 512
    with pytest.raises(DataError, match="exceeds the target's context of 512"):
        run_eval(EvalConfig(target=paths["target"], bench=bench, methods=("ar",), max_new_tokens=32,
                            out_dir=str(tmp_path / "out"), quiet=True, plots=False))


@pytest.mark.slow
def test_eval_cli_mamba_drafter_all_methods_two_temperatures(models, tmp_path, capsys):
    root, paths = models
    bench = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    parser = command.configure(argparse.ArgumentParser())
    args = parser.parse_args([
        "--target", paths["target"], "--drafter", paths["mamba_drafter"], "--bench", bench,
        "--temperature", "0,1", "--methods", "ar,chain,tree,ucb", "--tree", "2,2,1",
        "--ucb-trees", "2,1", "--ucb-trees", "1,1,1", "--max-new-tokens", "12", "--repeats", "2",
        "--out", str(tmp_path / "out"),
    ])
    assert command.run(args) == 0
    rep = json.loads((tmp_path / "out" / "report.json").read_text())
    expected = {str(i + 1): hf_greedy(paths["target"], p, 12) for i, p in enumerate(PROMPTS)}
    for r in rep["records"]:
        if r["temperature"] == 0:
            assert r["tokens"] == expected[r["prompt_id"]], (r["method"], r["prompt_id"])
    assert {r["method"] for r in rep["results"]} == {"ar", "chain", "tree", "ucb"}  # no hf_assisted for Mamba
    assert rep["skipped"] and rep["skipped"][0]["method"] == "hf_assisted"
    assert len(rep["records"]) == 4 * 2 * 2 * 2
    assert (tmp_path / "out" / "speedup.png").exists()
    md = (tmp_path / "out" / "report.md").read_text()
    assert all(f"]({p.name})" in md for p in (tmp_path / "out").glob("*.png"))
    assert [o["order"][0] for o in rep["manifest"]["method_order"]] == ["ar", "chain"] * 2  # 2 repeats × 2 T
    assert "| ucb | 1 |" in capsys.readouterr().out


@pytest.mark.slow
def test_benchmark_script_smoke(tmp_path):
    mod = spec_decode
    assert mod.main(["--random-models", "--num-prompts", "2", "--max-new-tokens", "8", "--repeats", "1",
                     "--out", str(tmp_path / "bench")]) == 0
    summary = json.loads((tmp_path / "bench" / "spec_decode.json").read_text())
    assert set(summary) == {"mamba", "transformer"}
    assert {r["method"] for r in summary["transformer"]["results"]} == {"ar", "chain", "tree", "hf_assisted"}


def test_eval_bf16_runs_the_classifying_self_check_end_to_end(models, tmp_path):
    """A real bf16 eval checks each output with the target (near_tie_checked) and finds no defect. Its outputs here
    equal AR's, so what a bf16 near-tie does to the run (reported, not failed; failed in fp32) is tested in
    tests/eval/test_runner.py::test_bf16_mismatch_is_reported_with_near_ties."""
    root, paths = models
    bench = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    rep = run_eval(EvalConfig(target=paths["target"], drafter=paths["transformer_drafter"], bench=bench,
                              max_new_tokens=6, methods=("ar", "chain"), baselines=("ar",), dtype="bfloat16",
                              out_dir=str(tmp_path / "out"), quiet=True, plots=False))
    assert rep["manifest"]["dtype"] == "bfloat16"
    sc = next(r for r in rep["results"] if r["method"] == "chain")["self_check"]
    assert sc["total"] == 2 and sc["defects"] == 0 and sc["near_tie_checked"]


@pytest.mark.parametrize("slope, chosen", [(0.0, 4), (1.0, 1)], ids=["flat-curve", "each-row-costs-a-token"])
def test_tune_chain_length_times_the_length_the_cost_model_picks(models, tmp_path, monkeypatch, slope, chosen):
    """The drafter is the target, so at T=0 every draft is accepted and τ(γ) = 1 + γ. With a flat verification
    curve every extra draft is nearly free and chain 4 wins; when each row costs as much as a token, a round of
    γ drafts costs at least (1 + γ)·t(1) and brings 1 + γ tokens, so drafting only loses and the shortest chain
    (1) wins. The timed chain drafts exactly the chosen length and its output is still the target's."""
    from draftforge.eval import cost

    root, paths = models
    monkeypatch.setattr(cost, "verify_curve", lambda target, ids, rows, repeats: {n: 0.01 * (1 + slope * (n - 1))
                                                                                  for n in rows})
    bench = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    rep = run_eval(EvalConfig(target=paths["target"], drafter=paths["target"], bench=bench, max_new_tokens=12,
                              methods=("ar", "chain"), baselines=(), method_options={"chain": {"chain_length": 4}},
                              tune_chain_length=True, out_dir=str(tmp_path / "out"), quiet=True, plots=False,
                              dtype="float32"))
    tuning = rep["cost_model"]["chain_tuning"][0.0]
    assert tuning["probed_length"] == 4 and sorted(tuning["predicted"]) == [1, 2, 3, 4]
    assert tuning["chosen"] == chosen == max(tuning["predicted"], key=tuning["predicted"].get)
    timed = [r for r in rep["records"] if r["method"] == "chain"]
    assert max(d for r in timed for d in r["stats"]["drafted_per_round"]) == chosen
    row = next(r for r in rep["results"] if r["method"] == "chain")
    assert row["chain_length"] == chosen and row["self_check"]["identical"] == 2
    assert f"timed at {chosen}." in (tmp_path / "out" / "report.md").read_text()


def test_tune_chain_length_needs_the_chain_and_the_cost_model(models, tmp_path):
    from draftforge.errors import RecipeError

    root, paths = models
    bench = write_prompts(tmp_path / "p.jsonl", PROMPTS)
    for kw in ({"methods": ("ar", "tree")}, {"methods": ("ar", "chain"), "cost_repeats": 0}):
        with pytest.raises(RecipeError, match="--tune-chain-length picks chain's draft length"):
            run_eval(EvalConfig(target=paths["target"], drafter=paths["target"], bench=bench, tune_chain_length=True,
                                out_dir=str(tmp_path / "out"), quiet=True, **kw))
    assert not (tmp_path / "out").exists()
