"""Task `eagle3`: only the head trains (the target stays bitwise as loaded), the loss falls, the export is the
speculators format and loads back into the harness with the same drafts, `draftforge export` rewrites the same
bytes, the per-step metrics come out, and bad recipes are refused before anything is built."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from draftforge.cli import main as cli_main
from draftforge.decode import build_decoder, load_drafter, load_target
from draftforge.decode.drafters.eagle3 import Eagle3Drafter, FeatureMambaDrafter
from draftforge.decode.sampling import SamplingParams
from draftforge.errors import CompatibilityError, RecipeError
from draftforge.recipe import recipe_from_dict
from draftforge.train.eagle3 import build_eagle3_task
from draftforge.train.loop import train
from tests.fixtures.decode import greedy_reference
from tests.train.test_eesd import LAYERS, save_target, token_rows


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tiny_tokenizer_dir):
    return save_target(tmp_path_factory.mktemp("target"), tiny_tokenizer_dir)


def recipe(tmp_path, target_dir, rows, model=None, **eagle3):
    return {
        "task": "eagle3", "output_dir": str(tmp_path / "run"),
        "model": {"target": str(target_dir), **(model or {})},
        "data": {"sources": [str(rows)], "format": "tokens", "eval_fraction": 0.1},
        "eagle3": {"steps": 3, **eagle3},
        "optim": {"lr": 3e-3, "warmup_steps": 0, "weight_decay": 0.0},
        "train": {"max_steps": 20, "global_batch_size": 8, "micro_batch_size": 4, "block_size": 32,
                  "eval_every": 20, "save_every": 20, "log_every": 5, "trackers": []},
    }


def train_run(values, target_dir):
    built = {}

    def build(r, acc, with_data=True):
        built["spec"] = spec = build_eagle3_task(r, acc, with_data)
        built["head0"] = {k: v.clone() for k, v in spec.model.state_dict().items()}
        return spec

    result = train(recipe_from_dict(values), build)
    spec = built["spec"]
    original = load_file(str(target_dir / "model.safetensors"))
    compared = 0
    for name, value in spec.frozen["target"].state_dict().items():  # as loaded (bf16 where training runs bf16)
        if name in original:
            assert torch.equal(value, original[name].to(value.dtype)), name
            compared += 1
    assert compared == len(original)  # every tensor of the file (a tied head adds a name the file has not)
    assert not any(p.requires_grad for p in spec.frozen["target"].parameters())
    for name, value in spec.model.state_dict().items():
        assert not torch.equal(value, built["head0"][name]), f"{name} did not train"
    return result, spec


@pytest.mark.parametrize("body", ["attention", "mamba2"])
def test_the_head_trains_exports_and_drafts_the_same_after_loading(tmp_path, target_dir, body):
    rows = token_rows(tmp_path / "rows.jsonl", target_dir)
    extra = {"body": "mamba2", "mamba_head_dim": 16, "state_size": 8} if body == "mamba2" else {}
    result, spec = train_run(recipe(tmp_path, target_dir, rows, model={"draft_vocab": 64}, **extra), target_dir)
    assert sum(result.losses[-3:]) / 3 < result.losses[0]
    export = result.export_dir
    if body == "attention":  # the speculators checkpoint vLLM serves
        config = json.loads((export / "config.json").read_text())
        assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 64
        assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # LAYERS = 4: the shallow-target choice
        assert config["speculators_config"]["verifier"]["name_or_path"] == str(target_dir)
    else:  # no engine serves it: no config an engine would read as an attention head
        assert not (export / "config.json").exists()
    meta = json.loads((export / "draftforge.json").read_text())
    acceptance = meta["metrics"]["acceptance"]
    assert {"alpha_at_step0", "top1_at_step2", "tau_ttt_greedy"} <= set(acceptance)
    assert 1.0 <= acceptance["tau_ttt_greedy"] <= 4.0

    target = load_target(str(target_dir))
    loaded = load_drafter(str(export), target)
    kind = Eagle3Drafter if body == "attention" else FeatureMambaDrafter
    assert type(loaded) is kind and loaded.d2t is not None and len(loaded.d2t) == 64
    in_memory = kind(spec.model.cpu().float(), target.vocab_size)
    seq = [5, 17, 42, 9, 100, 7]
    drafts = []
    for d in (loaded, in_memory):
        d.bind(target)
        target.prefill(seq)
        d.reset()
        drafts.append(d.draft(seq, (1,) * 5, SamplingParams(), torch.Generator()).tokens)
    assert drafts[0] == drafts[1] and len(drafts[0]) == 5

    dec = build_decoder("eagle2", target, loaded)
    prompt = [3, 9, 27, 81, 243]
    assert dec.generate(prompt, max_new_tokens=20).tokens == greedy_reference(target, prompt, 20)

    out = tmp_path / "again"  # `draftforge export RUN_DIR` rebuilds the head and writes the same weights
    assert cli_main(["export", str(result.run_dir), "--out", str(out)]) == 0
    assert (out / "model.safetensors").read_bytes() == (export / "model.safetensors").read_bytes()


def test_a_head_resumes_as_it_would_have_run(tmp_path, target_dir):
    from tests.fixtures.resume import assert_resume_matches_uninterrupted

    values = recipe(tmp_path, target_dir, token_rows(tmp_path / "rows.jsonl", target_dir), model={"draft_vocab": 64})
    values["train"].update(max_steps=6, eval_every=2, save_every=2, log_every=1)
    assert_resume_matches_uninterrupted(values, tmp_path, stop=3)


def test_bad_recipes_are_refused(tmp_path, target_dir):
    rows = tmp_path / "rows.jsonl"
    rows.write_text("")
    with pytest.raises(CompatibilityError, match=f"outside 0..{LAYERS - 1}"):
        recipe_from_dict(recipe(tmp_path, target_dir, rows, aux_layers=[1, LAYERS]))
    with pytest.raises(RecipeError, match="eagle3.steps"):
        recipe_from_dict(recipe(tmp_path, target_dir, rows, steps=0))
    with pytest.raises(RecipeError, match="eagle3.body"):
        recipe_from_dict(recipe(tmp_path, target_dir, rows, body="rwkv"))
    short = recipe(tmp_path, target_dir, rows, steps=12)  # more steps than an 8-token block has anchors for
    short["train"]["block_size"] = 8
    with pytest.raises(RecipeError, match="eagle3.steps.*train.block_size is 8"):  # eval crashed mid-run
        recipe_from_dict(short)
    short["eagle3"]["steps"] = 7
    recipe_from_dict(short)
    with pytest.raises(RecipeError, match="eagle3.loss"):
        recipe_from_dict(recipe(tmp_path, target_dir, rows, loss="ce"))
    values = recipe(tmp_path, target_dir, rows)
    del values["model"]["target"]
    with pytest.raises(RecipeError, match="model.target"):
        recipe_from_dict(values)


def test_a_run_starts_from_an_exported_head_and_refuses_one_of_another_shape(tmp_path, target_dir):
    rows = token_rows(tmp_path / "rows.jsonl", target_dir)
    first = recipe(tmp_path / "a", target_dir, rows, model={"draft_vocab": 64})
    first["train"].update(max_steps=4, eval_every=4, save_every=4)
    export = train(recipe_from_dict(first), build_eagle3_task).export_dir
    from draftforge.models.eagle3_export import load_head

    exported, _ = load_head(export)
    built = {}

    def build(r, acc, with_data=True):  # the head as the fine-tuning run builds it, before any step
        spec = build_eagle3_task(r, acc, with_data)
        built.setdefault("head0", {k: v.clone() for k, v in spec.model.state_dict().items()})
        built.setdefault("d2t", spec.run_files)
        return spec

    again = recipe(tmp_path / "b", target_dir, rows, model={"init_from": str(export.parent)})  # the run dir
    again["train"].update(max_steps=2, eval_every=2, save_every=2, block_size=64)  # a longer context
    result = train(recipe_from_dict(again), build)
    start = exported.float().state_dict()
    assert built["head0"].keys() == start.keys()
    assert all(torch.equal(built["head0"][k], start[k]) for k in start)
    assert json.loads(built["d2t"]["draft_vocab.json"]) == list(exported.config.draft_vocab)
    assert (result.export_dir / "model.safetensors").is_file()
    for body, key in (({"body": "mamba2"}, "eagle3.body"), ({"aux_layers": [0, 1, 2]}, "eagle3.aux_layers")):
        bad = recipe(tmp_path / key, target_dir, rows, model={"init_from": str(export)}, **body)
        with pytest.raises(RecipeError, match=key):
            train(recipe_from_dict(bad), build_eagle3_task)
    bad = recipe(tmp_path / "c", target_dir, rows, model={"init_from": str(target_dir)})
    with pytest.raises(RecipeError, match="not an eagle3 export"):
        train(recipe_from_dict(bad), build_eagle3_task)
