"""Extending a run: `--resume --set train.max_steps=N` continues a finished or killed run to N steps. Oracle: with a
constant schedule, 4 steps then an extension to 8 give the loss curve of one uninterrupted 8-step run, bitwise; with
a cosine schedule the change is announced with the learning rate before and after, and recorded in history.jsonl."""

from __future__ import annotations

import json

import pytest
import yaml

from draftforge.errors import CheckpointError
from draftforge.recipe import recipe_from_dict
from draftforge.train import run
from draftforge.train.loop import read_metrics
from tests.train.test_loop import tiny_recipe


def _losses(run_dir) -> list[float]:
    return [r["loss"] for r in read_metrics(run_dir) if "loss" in r and r.get("split", "train") == "train"]


def test_extending_a_constant_schedule_run_equals_one_uninterrupted_run(tmp_path, tiny_corpus_dir,
                                                                          tiny_tokenizer_dir):
    once = tiny_recipe(tmp_path / "a", tiny_corpus_dir, tiny_tokenizer_dir, max_steps=8)
    once["optim"]["schedule"] = "constant"
    whole = run(recipe_from_dict(once))
    short = {**once, "output_dir": str(tmp_path / "b" / "run"), "train": {**once["train"], "max_steps": 4}}
    run(recipe_from_dict(short))
    extended = run(recipe_from_dict({**short, "train": {**short["train"], "max_steps": 8}}), resume=True)
    assert extended.step == 8 and len(_losses(whole.run_dir)) == 8
    assert _losses(extended.run_dir) == _losses(whole.run_dir)  # bitwise: the same floats in the same order


def test_a_cosine_extension_is_announced_recorded_and_becomes_the_runs_recipe(tmp_path, tiny_corpus_dir,
                                                                               tiny_tokenizer_dir, capsys):
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=4)
    run(recipe_from_dict(values))
    longer = {**values, "train": {**values["train"], "max_steps": 6}}
    result = run(recipe_from_dict(longer), resume=True)
    out = capsys.readouterr().out
    assert result.step == 6
    assert "train.max_steps 4 -> 6: the cosine learning-rate schedule is recomputed over 6 steps" in out
    history = [json.loads(line) for line in (result.run_dir / "history.jsonl").read_text().splitlines()]
    assert history[-1]["resumed_at_step"] == 4 and history[-1]["changed"] == {"train.max_steps": [4, 6]}
    assert yaml.safe_load((result.run_dir / "recipe.yaml").read_text())["train"]["max_steps"] == 6
    assert run(recipe_from_dict(longer), resume=True).step == 6  # the same recipe again: nothing more to change


def test_max_steps_at_or_below_the_reached_step_and_other_changes_are_refused(tmp_path, tiny_corpus_dir,
                                                                              tiny_tokenizer_dir):
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=4)
    run(recipe_from_dict(values))
    with pytest.raises(CheckpointError, match="train.max_steps 3 is not past step 4"):
        run(recipe_from_dict({**values, "train": {**values["train"], "max_steps": 3}}), resume=True)
    with pytest.raises(CheckpointError, match="differs .* in optim.lr.*may change only train.max_steps"):
        run(recipe_from_dict({**values, "optim": {**values["optim"], "lr": 1e-2},
                              "train": {**values["train"], "max_steps": 8}}), resume=True)


def test_a_run_saved_before_a_field_existed_resumes(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    """A recipe.yaml without a field this version has (an option added later) reads it at its default: resuming is
    allowed, and a value that differs from the default is still refused."""
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=2)
    first = run(recipe_from_dict(values))
    saved = first.run_dir / "recipe.yaml"
    older = yaml.safe_load(saved.read_text())
    assert older["optim"].pop("min_lr_ratio") == 0.1  # as if written before optim.min_lr_ratio existed
    saved.write_text(yaml.safe_dump(older))
    assert run(recipe_from_dict({**values, "train": {**values["train"], "max_steps": 3}}), resume=True).step == 3
    with pytest.raises(CheckpointError, match="differs .* in optim.min_lr_ratio"):
        run(recipe_from_dict({**values, "optim": {**values["optim"], "min_lr_ratio": 0.5},
                              "train": {**values["train"], "max_steps": 4}}), resume=True)


def test_every_step_of_an_extended_cosine_run_uses_and_logs_the_new_schedules_rate(tmp_path, tiny_corpus_dir,
                                                                                    tiny_tokenizer_dir, monkeypatch):
    """By hand: step s of a run of N steps uses lr · factor(s − 1) of the schedule over N (optim.lr_lambda's
    formula, warm-up 0 here: lr · (min + (1 − min)·(1 + cos(π (s − 1)/N))/2)). The first step after an extension
    to 8 used the 4-step curve's rate (the optimizer's saved one), and metrics.jsonl logged each step's successor's
    rate."""
    import math

    from draftforge.train import loop

    used = {}
    inner = loop.Trainer.train_step

    def spy(self, micro, step):
        used[step] = self.opt.param_groups[0]["lr"]
        return inner(self, micro, step)

    monkeypatch.setattr(loop.Trainer, "train_step", spy)
    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=4, log_every=1)
    values["optim"].update(schedule="cosine", warmup_steps=0, lr=1e-2, min_lr_ratio=0.1)
    run(recipe_from_dict(values))
    result = run(recipe_from_dict({**values, "train": {**values["train"], "max_steps": 8}}), resume=True)

    def by_hand(step, total):
        return 1e-2 * (0.1 + 0.9 * (1 + math.cos(math.pi * (step - 1) / total)) / 2)

    for step in range(1, 5):
        assert used[step] == pytest.approx(by_hand(step, 4), rel=1e-12)
    for step in range(5, 9):
        assert used[step] == pytest.approx(by_hand(step, 8), rel=1e-12)
    logged = {r["step"]: r["lr"] for r in read_metrics(result.run_dir) if "lr" in r}
    assert logged == pytest.approx(used, rel=1e-12)


def test_an_extension_counts_from_the_checkpoint_the_run_resumes_from_not_a_damaged_newer_one(
        tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, capsys):
    # checkpoints at 2 and 4, the one at 4 truncated: the run continues from step 2, so the learning-rate note and
    # history.jsonl speak of step 2 (they said 4, the damaged one's step), and the damage is reported once
    from draftforge.train import checkpoint as ckpt

    values = tiny_recipe(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=4, keep_checkpoints=3)
    run(recipe_from_dict(values))
    newest = ckpt.list_checkpoints(values["output_dir"])[0]
    assert newest.name.endswith("00000004")
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    capsys.readouterr()
    result = run(recipe_from_dict({**values, "train": {**values["train"], "max_steps": 6}}), resume=True)
    out = capsys.readouterr().out
    assert result.step == 6 and len(result.losses) == 4  # steps 3..6, from the step-2 checkpoint
    assert out.count("is unusable (model.safetensors is truncated") == 1
    assert "so at step 2 the learning rate moves" in out
    history = [json.loads(line) for line in (result.run_dir / "history.jsonl").read_text().splitlines()]
    assert history[-1]["resumed_at_step"] == 2
