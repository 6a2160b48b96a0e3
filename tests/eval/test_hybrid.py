"""`draftforge eval` on a hybrid target (saved tiny Bamba) with a Mamba2 drafter: same report, self-check
and manifest as for Transformer targets, plus tokens computed and states held per verification."""

import json
from pathlib import Path

import pytest
import torch

from draftforge.eval.runner import EvalConfig, run_eval
from tests.fixtures.decode import tiny_mamba2
from tests.fixtures.hybrid import tiny_bamba

PROMPTS = [[5, 17, 42, 9], [3, 8, 12, 61, 7, 30, 2, 9, 14]]


def _saved(tmp_path, target_model, drafter_model) -> tuple[str, str, str]:
    """(target dir, drafter dir, bench file) written under tmp_path: the models and PROMPTS."""
    target, drafter, bench = tmp_path / "target", tmp_path / "drafter", tmp_path / "p.jsonl"
    target_model.save_pretrained(target)
    drafter_model.save_pretrained(drafter)
    bench.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    return str(target), str(drafter), str(bench)


def test_eval_on_a_hybrid_target_reports_verify_cost(tmp_path):
    model = tiny_bamba(vocab=64)
    target, drafter, bench = _saved(tmp_path, model, tiny_mamba2(vocab=64))
    rep = run_eval(EvalConfig(target=target, drafter=drafter, bench=bench, max_new_tokens=8,
                              methods=("ar", "chain", "tree", "ucb"),
                              method_options={"chain": {"chain_length": 4}, "tree": {"tree": (3, 1, 1, 1)}},
                              out_dir=str(tmp_path / "out"), quiet=True, plots=False, dtype="float32"))
    for r in rep["records"]:
        ids = torch.tensor([PROMPTS[int(r["prompt_id"]) - 1]])
        want = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False)
        assert r["tokens"] == want[0, ids.shape[1]:].tolist(), r["method"]
    rows = {row["method"]: row for row in rep["results"]}
    assert rows["tree"]["self_check"]["identical"] == rows["tree"]["self_check"]["total"] == 2
    assert rows["ar"]["verify_cost"]["tokens_per_verify"] == 1.0
    assert 1 < rows["tree"]["verify_cost"]["tokens_per_verify"] <= 13
    assert all(row["verify_cost"]["states_per_verify"] == 1 and row["verify_cost"]["ssm_layers"] == 2
               for row in rows.values())
    assert "per verification (2 SSM layers" in Path(rep["files"]["markdown"]).read_text()


def test_bf16_eval_on_a_hybrid_target_has_no_defect(tmp_path):
    """bf16 tree scan + replay: every prompt identical to bf16 AR or a measured near-tie."""
    target, drafter, bench = _saved(tmp_path, tiny_bamba(vocab=64), tiny_mamba2(vocab=64))
    rep = run_eval(EvalConfig(target=target, drafter=drafter, bench=bench, max_new_tokens=12,
                              methods=("ar", "chain", "tree"), dtype="bfloat16",
                              method_options={"chain": {"chain_length": 4}, "tree": {"tree": (3, 1, 1, 1)}},
                              out_dir=str(tmp_path / "out"), quiet=True, plots=False, cost_repeats=1))
    assert rep["manifest"]["dtype"] == "bfloat16"
    checked = {row["method"]: row["self_check"] for row in rep["results"] if row["self_check"] is not None}
    assert set(checked) == {"chain", "tree"}
    for sc in checked.values():
        assert sc["defects"] == 0 and sc["identical"] + sc["near_ties"] == sc["total"] == 2
    assert rep["cost_model"]["curve_s"] and all(r["cost_model"] for r in rep["results"])


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("kind", ["mamba2", "bamba"])
def test_a_tree_forward_that_drops_the_ssm_state_fails_the_self_check(tmp_path, monkeypatch, capsys, kind, dtype):
    """What transformers 5.24's rename did to the harness: every verification scanned from an empty SSM state.
    The self-check's tolerance comes from the model's own plain forward, not from the broken code, so it must
    report defects and `draftforge eval` exit 2, in bf16 as in fp32."""
    from draftforge import cli
    from draftforge.decode.targets import hybrid as hybrid_target
    from tests.fixtures.hybrid import tiny_mamba2_target

    target, drafter = tmp_path / kind, tmp_path / "drafter"
    model = (tiny_bamba if kind == "bamba" else tiny_mamba2_target)(vocab=64)
    with torch.no_grad():  # logits at a trained model's scale (|logit| ~ 10), not a random model's ~0.3
        model.config.tie_word_embeddings = False
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone() * 30)
    model.save_pretrained(target)
    tiny_mamba2(vocab=64).save_pretrained(drafter)
    bench = tmp_path / "p.jsonl"
    bench.write_text("".join(json.dumps({"input_ids": p}) + "\n" for p in PROMPTS))
    monkeypatch.setattr(hybrid_target, "cache_states", lambda cache, layer_idx: (None, None))
    out = tmp_path / "out"
    code = cli.main(["eval", "--target", str(target), "--drafter", str(drafter), "--bench", str(bench),
                     "--methods", "ar,chain", "--dtype", dtype, "--max-new-tokens", "12", "--out", str(out),
                     "--no-plots", "--cost-repeats", "1"])
    assert code == 2 and "defect(s)" in capsys.readouterr().err
    chain = next(r for r in json.loads((out / "report.json").read_text())["results"] if r["method"] == "chain")
    assert chain["self_check"]["defects"] >= 1


def test_eval_of_a_hybrid_target_with_a_transformer_drafter_skips_hf_assisted(tmp_path):
    """hf_assisted joins an eval with a Transformer drafter by default; on a hybrid target transformers 5.24
    raised mid-run ("assisted generation is not supported with stateful models"), ending the whole eval."""
    from tests.fixtures.decode import tiny_llama

    target, drafter, bench = _saved(tmp_path, tiny_bamba(vocab=64), tiny_llama(vocab=64))
    rep = run_eval(EvalConfig(target=target, drafter=drafter, bench=bench, max_new_tokens=8,
                              methods=("ar", "chain"), out_dir=str(tmp_path / "out"), quiet=True, plots=False,
                              cost_repeats=0))
    assert [row["method"] for row in rep["results"]] == ["ar", "chain"]
    assert [s["method"] for s in rep["skipped"]] == ["hf_assisted"]
    assert "needs a Transformer target with a KV cache, not 'bamba'" in rep["skipped"][0]["reason"]
