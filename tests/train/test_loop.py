"""The one training loop: learning, bitwise resume, checkpoint integrity, divergence, bad input."""

from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from draftforge.errors import CheckpointError, DraftforgeError, RecipeError
from draftforge.recipe import recipe_from_dict
from draftforge.train import checkpoint as ckpt
from draftforge.train import run
from draftforge.train.loop import TrainingDiverged, read_metrics


class Killed(Exception):
    """A kill, raised where a test puts it."""


def kill_at_save(monkeypatch, at: int) -> None:
    """The run dies when it would write step `at`'s checkpoint: that step is trained and logged, not saved."""
    from draftforge.train import loop

    real_save = loop.Trainer.save

    def save(self, step):
        if step == at:
            raise Killed
        real_save(self, step)

    monkeypatch.setattr(loop.Trainer, "save", save)


def tiny_recipe(tmp_path, corpus, tokenizer, **train) -> dict:
    return {
        "task": "pretrain",
        "output_dir": str(tmp_path / "run"),
        "model": {"arch": "mamba2", "size": "tiny", "tokenizer": str(tokenizer),
                  "overrides": {"hidden_size": 32, "num_hidden_layers": 2, "head_dim": 16, "state_size": 8}},
        "data": {"sources": [str(corpus)], "eval_fraction": 0.2},
        "optim": {"lr": 3e-3, "warmup_steps": 2},
        "train": {"max_steps": 6, "global_batch_size": 4, "micro_batch_size": 2, "block_size": 32,
                  "eval_every": 3, "save_every": 2, "log_every": 1, "trackers": [], "export": False, **train},
    }


def test_training_lowers_loss_and_changes_every_parameter(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=30, save_every=0)
    values["optim"]["lr"] = 1e-2
    recipe = recipe_from_dict(values)
    from draftforge.train.lm import build_model, load_tokenizer

    torch.manual_seed(recipe.train.seed)
    before = {k: v.clone() for k, v in build_model(recipe, load_tokenizer(recipe)).state_dict().items()}
    result = run(recipe)
    assert sum(result.losses[-3:]) / 3 < result.losses[0] - 0.5
    from safetensors.torch import load_file

    after = load_file(str(ckpt.list_checkpoints(result.run_dir)[0] / "model.safetensors"))
    for name, value in after.items():
        assert not torch.equal(value, before[name]), f"{name} did not change"
    assert result.eval_loss is not None


@pytest.mark.parametrize("arch", ["mamba2", "llama"])
def test_lora_with_its_default_targets_trains_and_exports_merged_weights(tmp_path, tiny_corpus_dir,
                                                                        tiny_tokenizer_dir, arch):
    """model.lora.enabled with no target_modules: the adapters train (the base weights stay as built) and the
    export holds plain weights that differ from the base. PEFT refuses a Mamba mixer's out_proj, which the
    Mamba default once named, so LoRA on a Mamba drafter failed before its first step."""
    from safetensors.torch import load_file

    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=1, save_every=0, export=True)
    if arch == "llama":
        values["model"].update(arch="llama", size="tiny-drafter",
                               overrides={"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
                                          "num_key_value_heads": 2, "intermediate_size": 64})
    base_dir = run(recipe_from_dict(values)).export_dir
    values["output_dir"] = str(tmp_path / "lora")
    values["model"].update(init_from=str(base_dir), lora={"enabled": True, "r": 4, "alpha": 8})
    values["train"]["max_steps"] = 3
    result = run(recipe_from_dict(values))
    base = load_file(str(base_dir / "model.safetensors"))
    exported = load_file(str(result.export_dir / "model.safetensors"))
    assert not any("lora" in name for name in exported) and exported.keys() == base.keys()
    changed = [name for name, value in exported.items() if not torch.equal(value, base[name])]
    wanted = {"mamba2": ("in_proj",), "llama": ("q_proj", "down_proj")}[arch]
    assert changed and all(any(w in name for name in changed) for w in wanted), changed


def test_lora_with_dropout_resumes_as_it_would_have_run(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    """LoRA dropout draws from the RNG every step: a resume must restore it (the checkpoint's RNG states)."""
    from tests.fixtures.resume import assert_resume_matches_uninterrupted

    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=1, save_every=0, export=True)
    values["output_dir"] = str(tmp_path / "base")
    values["model"]["init_from"] = str(run(recipe_from_dict(values)).export_dir)
    values["model"]["lora"] = {"enabled": True, "r": 4, "alpha": 8, "dropout": 0.3}
    values["train"].update(max_steps=6, eval_every=2, save_every=2)
    assert_resume_matches_uninterrupted(values, tmp_path, stop=3)


def test_resume_reproduces_uninterrupted_losses_bitwise(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    full = run(recipe_from_dict(tiny_recipe(tmp_path / "a", tiny_corpus_dir, tiny_tokenizer_dir)))
    part = recipe_from_dict(tiny_recipe(tmp_path / "b", tiny_corpus_dir, tiny_tokenizer_dir))
    first = run(part, stop_after=3)  # as if killed right after step 3 (checkpoint at 3 exists)
    assert first.step == 3
    second = run(part, resume=True)
    assert first.losses + second.losses == full.losses  # bitwise: fp32 on CPU
    logged = [r["loss"] for r in read_metrics(second.run_dir)]
    assert logged == full.losses
    a = ckpt.list_checkpoints(full.run_dir)[0] / "model.safetensors"
    b = ckpt.list_checkpoints(second.run_dir)[0] / "model.safetensors"
    assert a.read_bytes() == b.read_bytes()


def test_a_run_resumed_at_its_last_step_exports_the_losses_the_uninterrupted_run_exports(tmp_path, tiny_corpus_dir,
                                                                                         tiny_tokenizer_dir, capsys):
    # killed between its last checkpoint and its export: the resumed run has no step left, and once exported a
    # final loss of NaN (not JSON) and no eval loss, and said "loss nan, 0 tokens/s"
    full = run(recipe_from_dict(tiny_recipe(tmp_path / "a", tiny_corpus_dir, tiny_tokenizer_dir, export=True)))
    part = tiny_recipe(tmp_path / "b", tiny_corpus_dir, tiny_tokenizer_dir)  # export off: no export at step 6
    run(recipe_from_dict(part))
    part["train"]["export"] = True
    capsys.readouterr()
    resumed = run(recipe_from_dict(part), resume=True)
    assert resumed.step == 6 and resumed.losses == []
    want = json.loads((full.export_dir / "draftforge.json").read_text())["metrics"]
    got = json.loads((resumed.export_dir / "draftforge.json").read_text(), parse_constant=pytest.fail)["metrics"]
    assert got["final_loss"] == want["final_loss"] == full.losses[-1]  # bitwise: fp32 on CPU
    assert got["eval_loss"] == want["eval_loss"] is not None
    assert (resumed.final_loss, resumed.eval_loss) == (full.final_loss, full.eval_loss)
    assert "no step left to run" in capsys.readouterr().out


def test_corrupted_checkpoint_falls_back_to_previous(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, capsys):
    recipe = recipe_from_dict(tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, keep_checkpoints=3))
    run(recipe, stop_after=4)
    newest = ckpt.list_checkpoints(recipe.output_dir)[0]
    assert newest.name.endswith("00000004")
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # truncated, as a crash mid-copy would leave it
    (tmp_path / "run" / "checkpoints" / ".tmp-step-00000006").mkdir()  # a killed save's leftovers
    resumed = run(recipe, resume=True)
    assert "truncated" in capsys.readouterr().out
    assert resumed.step == 6 and len(resumed.losses) == 4  # steps 3..6 re-run from the step-2 checkpoint


def test_resume_refuses_missing_checkpoint_and_changed_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir)
    with pytest.raises(CheckpointError, match="no run"):
        run(recipe_from_dict(values), resume=True)
    run(recipe_from_dict(values), stop_after=1)
    shutil.rmtree(tmp_path / "run" / "checkpoints")
    with pytest.raises(CheckpointError, match="no checkpoint"):
        run(recipe_from_dict(values), resume=True)
    shutil.rmtree(tmp_path / "run")
    run(recipe_from_dict(values), stop_after=2)
    values["optim"]["lr"] = 1e-2
    with pytest.raises(CheckpointError, match="optim.lr"):
        run(recipe_from_dict(values), resume=True)


def test_resume_refuses_other_inputs_at_the_same_paths(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    """The recipe's paths are the same, what they hold is not: other rows, another target's weights. A resume
    trained on a mix of both; it is refused now, naming the input."""
    corpus = tmp_path / "corpus"
    shutil.copytree(tiny_corpus_dir, corpus)
    values = tiny_recipe(tmp_path, corpus, tiny_tokenizer_dir)
    run(recipe_from_dict(values), stop_after=2)
    inputs = json.loads((tmp_path / "run" / "inputs.json").read_text())
    assert list(inputs) == [f"data.sources {corpus}"] and inputs[f"data.sources {corpus}"]
    first = sorted(p for p in corpus.rglob("*") if p.is_file())[0]
    text = first.read_text()
    first.write_text("other text entirely\n" + text)
    with pytest.raises(CheckpointError, match=rf"--resume: data.sources {re.escape(str(corpus))} changed since"):
        run(recipe_from_dict(values), resume=True)
    first.write_text(text)  # put back: the run resumes
    assert run(recipe_from_dict(values), resume=True).step == values["train"]["max_steps"]
    # a target whose weights file was swapped at the same path
    from draftforge.train.rundir import recipe_inputs
    from tests.fixtures.decode import tiny_llama

    target = tmp_path / "target"
    tiny_llama(vocab=64).save_pretrained(target)
    values["model"]["target"] = str(target)
    before = recipe_inputs(recipe_from_dict(values))["model.target"]
    tiny_llama(vocab=64, seed=1).save_pretrained(target)
    assert recipe_inputs(recipe_from_dict(values))["model.target"] != before


def test_resume_takes_a_path_spelt_another_way_as_the_same_input(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir,
                                                                   monkeypatch):
    """The demo records its testbed's absolute paths; recipes/tiny names them through the runs/demo/testbed link.
    `train recipes/tiny/pretrain.yaml --resume` was refused on data.sources and model.target, compared as text;
    the same files through a link, or relative, resume now, and other content behind the new spelling does not."""
    corpus = tmp_path / "corpus"
    shutil.copytree(tiny_corpus_dir, corpus)
    values = tiny_recipe(tmp_path, corpus, tiny_tokenizer_dir)
    run(recipe_from_dict(values), stop_after=2)
    (tmp_path / "link").symlink_to(corpus, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    values["data"]["sources"] = ["link"]
    first = sorted(p for p in corpus.rglob("*") if p.is_file())[0]
    text = first.read_text()
    first.write_text("other text entirely\n" + text)
    with pytest.raises(CheckpointError, match=r"--resume: data.sources .*corpus changed since"):
        run(recipe_from_dict(values), resume=True)
    first.write_text(text)
    assert run(recipe_from_dict(values), resume=True).step == values["train"]["max_steps"]


def test_resume_refuses_another_init_checkpoint_or_cache_at_the_same_path(tmp_path, tiny_corpus_dir,
                                                                         tiny_tokenizer_dir):
    """model.init_from's weights and a task's cache are inputs too: other weights exported at the init path (or a
    logits cache harvested again with another top-k at the cache path) are named on --resume, not trained on."""
    from safetensors.torch import load_file, save_file

    from draftforge.train.rundir import recipe_inputs

    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=1, save_every=0, export=True)
    values["output_dir"] = str(tmp_path / "base")
    weights = run(recipe_from_dict(values)).export_dir / "model.safetensors"
    values["output_dir"], values["model"]["init_from"] = str(tmp_path / "run"), str(tmp_path / "base")
    values["train"].update(max_steps=4, save_every=2, export=False)
    run(recipe_from_dict(values), stop_after=2)
    assert list(json.loads((tmp_path / "run" / "inputs.json").read_text())["model.init_from"]) == [weights.name]
    before = weights.read_bytes()
    save_file({k: v + 1.0 for k, v in load_file(str(weights)).items()}, str(weights), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="--resume: model.init_from changed since"):
        run(recipe_from_dict(values), resume=True)
    weights.write_bytes(before)  # put back: the run resumes
    assert run(recipe_from_dict(values), resume=True).step == 4
    values["model"]["init_from"] = str(weights.parent)  # the export itself, not the run dir: the same weights
    assert list(recipe_inputs(recipe_from_dict(values))["model.init_from"]) == [weights.name]
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "manifest.json").write_text('{"k": 8}')
    values.update(task="distill", distill={"logits_cache": str(cache)})  # recipe_inputs alone: no cache to train on
    values["model"]["target"] = str(weights.parent)
    (tmp_path / "rows.jsonl").write_text('{"input_ids": [1, 2, 3]}\n')
    values["data"].update(format="tokens", sources=[str(tmp_path / "rows.jsonl")])
    before = recipe_inputs(recipe_from_dict(values))[f"distill.logits_cache {cache}"]
    (cache / "manifest.json").write_text('{"k": 2}')
    assert recipe_inputs(recipe_from_dict(values))[f"distill.logits_cache {cache}"] != before


def test_output_dir_with_another_run_needs_overwrite(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=1)
    run(recipe_from_dict(values))
    with pytest.raises(DraftforgeError, match="already holds a run"):
        run(recipe_from_dict(values))
    assert run(recipe_from_dict(values), overwrite=True).step == 1


def test_nan_loss_stops_and_keeps_last_good_checkpoint(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, monkeypatch):
    import draftforge.train.lm as lm

    real = lm.lm_loss
    calls = {"n": 0}

    def poisoned(model, batch):
        calls["n"] += model.training  # eval calls do not count
        s, n, m = real(model, batch)
        return (s * float("nan") if calls["n"] > 8 else s), n, m  # step 5 onward (2 micro-batches/step)

    monkeypatch.setattr(lm, "lm_loss", poisoned)
    recipe = recipe_from_dict(tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir))
    with pytest.raises(TrainingDiverged, match="step 5"):
        run(recipe)
    good = ckpt.latest_valid(recipe.output_dir)
    assert json.loads((good / "loop_state.json").read_text())["step"] == 4


@pytest.mark.parametrize("key,value,match", [
    ("train.micro_batch_size", 0, "train.micro_batch_size"),
    ("train.global_batch_size", 5, "multiple of micro_batch_size"),
    ("optim.schedule", "cosnie", "optim.schedule"),
    ("train.max_stpes", 3, "did you mean 'max_steps'"),
    ("train.block_size", "big", "train.block_size"),
    ("data.format", "chat", None),  # valid for pretrain as data format; sft requires it
    ("task", "sft", "model.init_from"),  # at load time: `--overwrite` must not delete a run first
    # these crashed in torch / numpy with a traceback, ran to a NaN loss, or were ignored
    ("optim.eps", -1, "optim.eps"), ("optim.eps", 0, "optim.eps"), ("optim.lr", ".inf", "optim.lr"),
    ("optim.weight_decay", -5, "optim.weight_decay"), ("train.seed", -1, "train.seed"),
    ("data.eval_fraction", 0, None),  # fine alone ...
    ("train.trackers", "[tensorbord]", "train.trackers.*tensorbord"),  # was a traceback from Accelerate
    ("train.trackers", "tensorboard", "train.trackers"), ("train.trackers", "[auto, tensorboard]", None),
])
def test_recipe_validation_names_the_key(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, key, value, match):
    from draftforge.recipe import apply_overrides

    values = apply_overrides(tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir), [f"{key}={value}"])
    if match is None:
        recipe_from_dict(values)
        return
    with pytest.raises(RecipeError, match=match):
        recipe_from_dict(values)


def test_keep_best_without_held_out_data_is_refused(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    """... but with keep_best the last step's weights were exported silently, as if none had been better."""
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, keep_best="loss")
    values["data"]["eval_fraction"] = 0
    with pytest.raises(RecipeError, match="train.keep_best.*needs held-out data"):
        recipe_from_dict(values)


def test_keep_best_with_a_held_out_set_that_comes_out_empty_is_refused_and_said(tmp_path, tiny_tokenizer_dir, capsys):
    # one document holds nothing out: the run trained without eval and exported the last step's weights, which
    # train.keep_best exists to prevent; without keep_best the data line now says it is not evaluated
    one = tmp_path / "one.txt"
    one.write_text("def add(a, b):\n    return a + b\n" * 40)
    values = tiny_recipe(tmp_path, one, tiny_tokenizer_dir, keep_best="loss", max_steps=2)
    with pytest.raises(DraftforgeError, match="train.keep_best: loss needs held-out data, and the held-out set came "
                                              "out empty"):
        run(recipe_from_dict(values))
    assert not (tmp_path / "run").exists()
    values = tiny_recipe(tmp_path, one, tiny_tokenizer_dir, max_steps=1, save_every=0, eval_every=0)
    run(recipe_from_dict(values))
    assert "warning: no held-out blocks: the recipe asks for held-out data" in capsys.readouterr().out


def test_block_size_beyond_model_context_fails_before_training(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir,
                                                                monkeypatch):
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, block_size=64)
    values["model"] = {"arch": "llama", "size": None, "tokenizer": str(tiny_tokenizer_dir),
                       "overrides": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                     "num_attention_heads": 2, "num_key_value_heads": 2,
                                     "max_position_embeddings": 48}}
    import draftforge.train.lm as lm

    def no_build(*a, **k):
        raise AssertionError("a model was built before the context check")

    monkeypatch.setattr(lm, "build_model", no_build)
    with pytest.raises(RecipeError, match="train.block_size"):
        run(recipe_from_dict(values))


@pytest.mark.parametrize("model, match", [
    ({"arch": "mamba2", "size": "tinny"}, "unknown Mamba preset 'tinny'"),
    ({"arch": "mamba", "size": "tiny", "overrides": {"hidden_size": 0}}, "hidden_size"),
])
def test_a_mamba_preset_or_override_typo_fails_before_tokenizing(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir,
                                                                 monkeypatch, model, match):
    # caught when the model was built, after the data: minutes of tokenizing on a real corpus
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir)
    values["model"] = {**model, "tokenizer": str(tiny_tokenizer_dir)}
    import draftforge.data as data

    def no_data(*a, **k):
        raise AssertionError("the data was built before the model settings were checked")

    monkeypatch.setattr(data, "build_block_data", no_data)
    with pytest.raises(RecipeError, match=match):
        run(recipe_from_dict(values))


def test_a_tracker_that_is_not_installed_is_refused_before_anything_is_written(tmp_path, tiny_corpus_dir,
                                                                              tiny_tokenizer_dir, monkeypatch):
    # Accelerate drops a tracker it cannot import with a log line: a recipe naming wandb trained, exit 0, and
    # logged nothing anywhere but metrics.jsonl
    import accelerate.tracking

    monkeypatch.setattr(accelerate.tracking, "get_available_trackers", lambda: [])
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=2)
    values["train"]["trackers"] = ["wandb"]
    with pytest.raises(RecipeError, match=r"'train.trackers': wandb not installed here \(the run would log nothing "
                                          r"to it\): pip install wandb, or drop it"):
        run(recipe_from_dict(values))
    assert not (tmp_path / "run").exists()
    monkeypatch.undo()
    values["train"]["trackers"] = ["auto"]  # tensorboard where installed: nothing to refuse
    assert run(recipe_from_dict(values)).step == 2


def test_export_refuses_another_runs_checkpoint(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    # `export RUN --checkpoint OTHER_RUN/checkpoints/step-N` wrote the other run's weights under this run's task,
    # recipe and metrics, with exit 0
    from draftforge.train.export_run import export_checkpoint

    mine = tiny_recipe(tmp_path / "mine", tiny_corpus_dir, tiny_tokenizer_dir, max_steps=2, save_every=2)
    other = tiny_recipe(tmp_path / "other", tiny_corpus_dir, tiny_tokenizer_dir, max_steps=2, save_every=2)
    other["optim"]["lr"] = 1e-2
    a, b = run(recipe_from_dict(mine)), run(recipe_from_dict(other))
    theirs = ckpt.list_checkpoints(b.run_dir)[0]
    with pytest.raises(CheckpointError, match=rf"--checkpoint {theirs} was written by another run \(its recipe "
                                              r"differs from .* in optim.lr\); export it from its own run"):
        export_checkpoint(a.run_dir, tmp_path / "out", checkpoint=str(theirs), say=lambda *x: None)
    assert not (tmp_path / "out").exists()
    own = export_checkpoint(a.run_dir, tmp_path / "own", checkpoint=str(ckpt.list_checkpoints(a.run_dir)[0]),
                            say=lambda *x: None)
    assert (own / "model.safetensors").is_file()


def test_a_re_export_keeps_what_the_runs_own_export_recorded(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    # `draftforge export RUN` builds the task without its data: data_stats (and a distill's teacher, C2T's harvest
    # figures, an eval's acceptance) went missing from a re-export of the very weights the run exported
    from draftforge.train.export_run import export_checkpoint

    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=2, save_every=2, export=True)
    done = run(recipe_from_dict(values))
    own_file = done.export_dir / "draftforge.json"
    own = json.loads(own_file.read_text())
    assert own["data_stats"]
    own["metrics"]["acceptance"] = {"tau": 2.5}  # a report on these weights, as distill's and eagle3's exports hold
    own_file.write_text(json.dumps(own))
    again = json.loads((export_checkpoint(done.run_dir, tmp_path / "again", say=lambda *x: None)
                        / "draftforge.json").read_text())
    assert again["data_stats"] == own["data_stats"] and again["metrics"]["acceptance"] == {"tau": 2.5}
    own["metrics"]["steps"] = 1  # the run's own export holds other weights: its report is not these weights'
    own_file.write_text(json.dumps(own))
    other = json.loads((export_checkpoint(done.run_dir, tmp_path / "other", say=lambda *x: None)
                        / "draftforge.json").read_text())
    assert other["data_stats"] == own["data_stats"] and "acceptance" not in other["metrics"]


def test_keep_best_exports_the_best_evals_weights_and_survives_resume(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    from safetensors.torch import load_file

    train = dict(max_steps=6, eval_every=1, save_every=1, keep_checkpoints=6, export=True, keep_best="loss")
    values = tiny_recipe(tmp_path / "a", tiny_corpus_dir, tiny_tokenizer_dir, **train)
    values["optim"].update(lr=1.0, schedule="constant", warmup_steps=0)  # so large the eval loss bounces
    full = run(recipe_from_dict(values))
    evals = {r["step"]: r["eval_loss"] for r in read_metrics(full.run_dir) if "eval_loss" in r}
    best = min(evals, key=evals.get)
    assert best != 6, f"the test needs a run whose last eval is not its best: {evals}"
    meta = json.loads((full.export_dir / "draftforge.json").read_text())
    assert meta["metrics"]["kept"] == {"metric": "loss", "value": evals[best], "step": best}
    # the figures beside it are the kept weights' (they were the last step's: eval_loss of step 6)
    assert (meta["metrics"]["steps"], meta["metrics"]["eval_loss"]) == (best, evals[best])
    assert (meta["metrics"]["last_step"]["steps"], meta["metrics"]["last_step"]["eval_loss"]) == (6, evals[6])
    at_best = next(c for c in ckpt.list_checkpoints(full.run_dir) if ckpt.read_loop_state(c)["step"] == best)
    kept, exported = load_file(str(at_best / "model.safetensors")), load_file(str(full.export_dir / "model.safetensors"))
    shared = set(kept) & set(exported)
    assert shared and all(torch.equal(kept[k], exported[k]) for k in shared)
    # `draftforge export RUN_DIR` exports what the run's own export did (the kept weights); --last the last step's
    from draftforge.train.export_run import export_checkpoint

    again = export_checkpoint(full.run_dir, tmp_path / "again", say=lambda *a: None)
    again_metrics = json.loads((again / "draftforge.json").read_text())["metrics"]
    assert again_metrics["kept"]["step"] == best and again_metrics["eval_loss"] == evals[best]
    assert all(torch.equal(load_file(str(again / "model.safetensors"))[k], exported[k]) for k in exported)
    last = export_checkpoint(full.run_dir, tmp_path / "last", last=True)
    at_last = load_file(str(ckpt.latest_valid(full.run_dir) / "model.safetensors"))
    last_w = load_file(str(last / "model.safetensors"))
    assert "kept" not in json.loads((last / "draftforge.json").read_text())["metrics"]
    assert set(at_last) & set(last_w) and all(torch.equal(at_last[k], last_w[k]) for k in set(at_last) & set(last_w))
    assert not all(torch.equal(last_w[k], exported[k]) for k in exported)
    # a record that cannot be read: the last step's weights were exported as if they were the best, silently
    record = full.run_dir / "best" / "best.json"
    good = record.read_text()
    record.write_text(good[:10])
    with pytest.raises(CheckpointError, match=r"best.json cannot be read .*--last. exports the last checkpoint's"):
        export_checkpoint(full.run_dir, tmp_path / "corrupt", say=lambda *a: None)
    record.write_text(good)
    # an --out of someone's files is refused before the task's model is built (a distill target would load first)
    import draftforge.train as export_run  # export_checkpoint reads draftforge.train.task_builder when called

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("mine")
    built = []
    real_builder = export_run.task_builder
    try:
        export_run.task_builder = lambda task: built.append(task) or real_builder(task)
        with pytest.raises(CheckpointError, match="not a readable draftforge export"):
            export_checkpoint(full.run_dir, tmp_path / "mine", say=lambda *a: None)
    finally:
        export_run.task_builder = real_builder
    assert built == [] and [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]

    values_b = tiny_recipe(tmp_path / "b", tiny_corpus_dir, tiny_tokenizer_dir, **train)
    values_b["optim"].update(lr=1.0, schedule="constant", warmup_steps=0)
    part = recipe_from_dict(values_b)
    run(part, stop_after=best + 1)  # killed after the best eval: its weights are kept in run/best
    resumed = run(part, resume=True)
    again = load_file(str(resumed.export_dir / "model.safetensors"))
    assert all(torch.equal(again[k], exported[k]) for k in exported)


def test_a_resume_keeps_the_best_record_its_checkpoint_saw(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir,
                                                          monkeypatch):
    """Killed after a new best (step 5) and before that step's checkpoint, then resumed from step 4 with another
    eval cadence (train.eval_every may change on --resume): step 5's record is not the resumed run's, but the one
    step 4's checkpoint saw is, and it was lost with the replaced best/ (the export kept a worse later eval).
    Oracle: the kept record is the best eval that metrics.jsonl records, and its weights are that step's."""
    from safetensors.torch import load_file

    train = dict(max_steps=9, eval_every=1, save_every=4, keep_checkpoints=10, export=True, keep_best="loss")
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, **train)
    values["optim"].update(lr=0.3, schedule="constant", warmup_steps=0)
    kill_at_save(monkeypatch, 5)
    with pytest.raises(Killed):
        run(recipe_from_dict(values), stop_after=5)
    monkeypatch.undo()
    evals = {r["step"]: r["eval_loss"] for r in read_metrics(tmp_path / "run") if "eval_loss" in r}
    best_to_4 = min((s for s in evals if s <= 4), key=evals.get)
    assert json.loads((tmp_path / "run" / "best" / "best.json").read_text())["step"] == 5, (
        f"the test needs step 5 to be a new best: {evals}")
    # `draftforge export RUN_DIR` of the killed run exports what a resume keeps, and changes nothing in the run
    from draftforge.train.export_run import export_checkpoint

    before = sorted(p.relative_to(tmp_path / "run") for p in (tmp_path / "run").rglob("*"))
    out = export_checkpoint(tmp_path / "run", tmp_path / "exported", say=lambda *a: None)
    assert json.loads((out / "draftforge.json").read_text())["metrics"]["kept"]["step"] == best_to_4
    assert sorted(p.relative_to(tmp_path / "run") for p in (tmp_path / "run").rglob("*")) == before
    values["train"]["eval_every"] = 2
    result = run(recipe_from_dict(values), resume=True)
    evals = {r["step"]: r["eval_loss"] for r in read_metrics(result.run_dir) if "eval_loss" in r}
    assert 5 not in evals and best_to_4 in evals
    best = min(evals, key=evals.get)
    kept = json.loads((result.export_dir / "draftforge.json").read_text())["metrics"]["kept"]
    assert kept == {"metric": "loss", "value": evals[best], "step": best}
    if best in (4, 8):  # a checkpoint step: the exported weights are its weights
        at = load_file(str(result.run_dir / "checkpoints" / f"step-{best:08d}" / "model.safetensors"))
        exported = load_file(str(result.export_dir / "model.safetensors"))
        assert all(torch.equal(at[k], exported[k]) for k in set(at) & set(exported))
    assert not (result.run_dir / ".best-at-checkpoint").exists()


def test_tensorboard_drops_what_a_killed_run_logged_after_its_checkpoint(tmp_path, tiny_corpus_dir,
                                                                         tiny_tokenizer_dir, monkeypatch):
    """Killed after step 3 was logged but before its checkpoint (the last is step 2): metrics.jsonl drops step 3
    on --resume, and TensorBoard must too, or the resumed run's step 3 shows twice."""
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    kill_at_save(monkeypatch, 3)
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=5, save_every=2,
                         trackers=["tensorboard"])
    with pytest.raises(Killed):
        run(recipe_from_dict(values), stop_after=3)
    monkeypatch.undo()
    run(recipe_from_dict(values), resume=True)
    events = EventAccumulator(str(tmp_path / "run" / "logs" / "draftforge"))  # both runs' event files
    events.Reload()
    steps = [e.step for e in events.Scalars("loss")]
    logged = [r["step"] for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert steps == logged == [1, 2, 3, 4, 5]


def test_keep_best_names_the_metrics_the_eval_logs(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, keep_best="tau_g5")
    with pytest.raises(DraftforgeError, match="train.keep_best: the eval logs no metric 'tau_g5'; it logs: loss"):
        run(recipe_from_dict(values))


def test_eval_at_start_logs_the_starting_weights_and_they_compete_for_keep_best(tmp_path, tiny_corpus_dir,
                                                                                   tiny_tokenizer_dir):
    from safetensors.torch import load_file

    from draftforge.train.lm import build_model, load_tokenizer

    train = dict(max_steps=4, eval_every=2, export=True, keep_best="loss")
    values = tiny_recipe(tmp_path / "a", tiny_corpus_dir, tiny_tokenizer_dir, eval_at_start=True, **train)
    values["optim"].update(lr=1.0, schedule="constant", warmup_steps=0)  # every step makes the model worse
    started = run(recipe_from_dict(values))
    evals = {r["step"]: r["eval_loss"] for r in read_metrics(started.run_dir) if "eval_loss" in r}
    assert sorted(evals) == [0, 2, 4]
    assert min(evals, key=evals.get) == 0, f"the test needs a run that never beats its start: {evals}"
    recipe = recipe_from_dict(values)
    torch.manual_seed(recipe.train.seed)  # the loop builds the model under this seed: the starting weights
    start = build_model(recipe, load_tokenizer(recipe)).state_dict()
    exported = load_file(str(started.export_dir / "model.safetensors"))
    assert exported and all(torch.equal(exported[k], start[k]) for k in exported)

    plain = tiny_recipe(tmp_path / "b", tiny_corpus_dir, tiny_tokenizer_dir, **train)
    plain["optim"].update(lr=1.0, schedule="constant", warmup_steps=0)
    without = run(recipe_from_dict(plain))
    assert without.losses == started.losses  # the extra eval leaves training bitwise as it was
    assert {r["step"]: r["eval_loss"] for r in read_metrics(without.run_dir) if "eval_loss" in r} == \
        {2: evals[2], 4: evals[4]}


def test_keep_best_direction_and_non_finite_values(tmp_path):
    """By hand: a divergence (kl, tvd, ce and per-step forms) is better when lower (keep_best: kl kept the worst
    weights), any other metric when higher; a NaN eval never becomes the record (a first NaN did, and then nothing
    beat it)."""
    from draftforge.train.best import BestKeeper

    def seen(metric, values):
        keeper = BestKeeper(metric, tmp_path, 0)
        kept = []
        for v in values:
            if keeper.improves(v):
                keeper.record = {"value": v}
                kept.append(v)
        return kept

    assert seen("kl", [0.5, 0.9, 0.4]) == [0.5, 0.4]
    assert seen("kl_step0", [0.5, 0.9, 0.4]) == seen("tvd", [0.5, 0.9, 0.4]) == seen("ce_target", [0.5, 0.9, 0.4])
    assert seen("loss", [2.0, 3.0, 1.0]) == [2.0, 1.0]
    assert seen("tau_ttt_greedy", [2.0, 1.5, 2.5]) == [2.0, 2.5]
    assert seen("alpha", [float("nan"), 0.3, float("inf"), 0.2, 0.4]) == [0.3, 0.4]


def test_a_run_killed_before_its_first_checkpoint_logs_its_start_eval_once(tmp_path, tiny_corpus_dir,
                                                                             tiny_tokenizer_dir, monkeypatch):
    """eval_at_start, then a kill in step 1 (no checkpoint yet; a kill runs no clean-up, so abandon is skipped),
    then --resume restarts from step 0: metrics.jsonl held the step-0 eval twice."""
    from draftforge.train import loop
    from draftforge.train.rundir import RunDir

    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=2, eval_at_start=True)

    class Killed(BaseException):
        pass

    def killed(self, micro, step):
        raise Killed

    with monkeypatch.context() as patch:
        patch.setattr(loop.Trainer, "train_step", killed)
        patch.setattr(RunDir, "abandon", lambda self: None)
        with pytest.raises(Killed):
            run(recipe_from_dict(values))
    assert [r["step"] for r in read_metrics(values["output_dir"])] == [0]
    run(recipe_from_dict(values), resume=True)
    steps = [r["step"] for r in read_metrics(values["output_dir"])]
    assert steps.count(0) == 1 and steps[-1] == 2


def test_a_moved_run_exports_its_own_draft_vocabulary(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    """`draftforge export RUN_DIR` rebuilt the model from the recipe's output_dir, where a moved run's recipe still
    points: it read whatever draft_vocab.json lay there now (another run's map of the same size: the head's rows
    paired with the wrong target ids, lossless but accepting little), or refused when nothing did."""
    import shutil

    from draftforge.train.export_run import export_checkpoint

    values = tiny_recipe(tmp_path / "a", tiny_corpus_dir, tiny_tokenizer_dir, max_steps=2)
    values["model"]["draft_vocab"] = 64
    first = run(recipe_from_dict(values)).run_dir
    moved = tmp_path / "moved"
    shutil.copytree(first, moved)
    own = json.loads((moved / "draft_vocab.json").read_text())
    other = [i for i in range(300) if i not in own][:64]
    (first / "draft_vocab.json").write_text(json.dumps(other))  # the old place now holds another run's map
    out = export_checkpoint(moved, tmp_path / "out", say=lambda *a: None)
    assert json.loads((out / "config.json").read_text())["draft_vocab"] == own
    shutil.rmtree(first)
    out = export_checkpoint(moved, tmp_path / "out2", say=lambda *a: None)
    assert json.loads((out / "config.json").read_text())["draft_vocab"] == own


def test_train_help_lists_everything_a_run_writes(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, capsys):
    # `train --help` did not say what a run writes; its list must name every entry a run (resumed with a longer
    # max_steps, exporting, keeping the best, with a tracker) leaves in output_dir, and nothing it never writes
    from draftforge.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out.split("what a run writes", 1)[1].split("\n\n", 1)[0]
    listed = set(re.findall(r"^  ([a-z_.]+)/?\s{2,}", text, re.M))
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=2, export=True, keep_best="loss",
                         eval_every=1, trackers=["tensorboard"])
    run(recipe_from_dict(values))
    result = run(recipe_from_dict(values, ["train.max_steps=3"]), resume=True)
    written = {p.name for p in result.run_dir.iterdir() if not p.name.startswith(".")}
    assert written == listed, (written, listed)
    assert not [p.name for p in tmp_path.iterdir() if p.name not in ("run",)]  # the lock beside it is gone


def test_a_tokenizer_that_is_not_the_targets_is_refused_before_training(tmp_path, tiny_corpus_dir,
                                                                        tiny_tokenizer_dir):
    """model.tokenizer and model.target naming different tokenizers: only the sizes were compared, so a drafter
    that tokenizes differently trained to the end and failed only when paired with its target."""
    from transformers import AutoTokenizer, LlamaConfig

    from draftforge.train.parts import load_tokenizer

    target = tmp_path / "target"
    other = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    other.add_tokens(["<tool>"])
    other.save_pretrained(target)
    LlamaConfig(vocab_size=len(other), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, num_key_value_heads=2).save_pretrained(target)
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir)
    values["model"]["target"] = str(target)
    with pytest.raises(RecipeError, match=r"model.tokenizer.* is not the tokenizer of model.target"):
        load_tokenizer(recipe_from_dict(values))
    values["model"]["tokenizer"] = str(target)  # the target's own: fine
    assert len(load_tokenizer(recipe_from_dict(values))) == len(other)


@pytest.mark.parametrize("warmup, warned", [(2, False), (6, True), (9, True)])
def test_a_warmup_as_long_as_the_run_is_named_at_the_start(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, capsys,
                                                             warmup, warned):
    # warmup_steps >= max_steps trained at a fraction of optim.lr with nothing said (the default warm-up of 100
    # under a `--set train.max_steps=20` smoke run): legal, so said, not refused
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=6, save_every=0, eval_every=0)
    values["optim"]["warmup_steps"] = warmup
    result = run(recipe_from_dict(values))
    out = capsys.readouterr().out
    last_lr = read_metrics(result.run_dir)[-1]["lr"]  # the rate the last step used, as logged
    if warned:  # hand computation: the 6th step (index 5) of a linear warm-up runs at (5 + 1) / (warmup + 1) x 3e-3
        assert last_lr == pytest.approx(3e-3 * 6 / (warmup + 1))
    line = (f"warning: optim.warmup_steps ({warmup}) >= train.max_steps (6): the learning rate rises to "
            f"{last_lr / 3e-3:.2g} x optim.lr at the last step and never decays")
    assert (line in out) == warned
