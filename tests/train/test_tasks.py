"""The task plug-in point and the run directory's safety.

A throwaway task (tests/train/plugin_task.py: feature rows, own recipe section, frozen module, metric,
export hook) trains through the unchanged loop on 1 process (here) and 2 processes (slow). The
run directory is left as it was when a run fails before its first checkpoint, a replaced run comes
back when its replacement fails, and a run killed early resumes from step 0.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from draftforge.cli import main as cli_main
from draftforge.errors import CheckpointError, DataError, RecipeError
from draftforge.recipe import recipe_from_dict
from draftforge.train import checkpoint as ckpt
from draftforge.train import run
from draftforge.train.loop import read_metrics


def probe_recipe(tmp_path, **train) -> dict:
    return {
        "task": "probe", "plugins": ["tests.train.plugin_task"], "output_dir": str(tmp_path / "probe-run"),
        "model": {"tokenizer": "unused"}, "data": {"sources": ["synthetic"]},
        "probe": {"hidden": 16, "rows": 256},
        "optim": {"lr": 3e-2, "warmup_steps": 0, "weight_decay": 0.0},
        "train": {"max_steps": 40, "global_batch_size": 32, "micro_batch_size": 16, "block_size": 1,
                  "eval_every": 20, "save_every": 20, "log_every": 5, "trackers": [], **train},
    }


def test_plugin_task_trains_logs_its_metric_keeps_frozen_parts_and_exports(tmp_path):
    from tests.train import plugin_task

    result = run(recipe_from_dict(probe_recipe(tmp_path)))
    assert sum(result.losses[-5:]) / 5 < result.losses[0] - 0.2
    logged = read_metrics(result.run_dir)
    assert all("accuracy" in r and 0.0 <= r["accuracy"] <= 1.0 for r in logged)
    assert logged[-1]["accuracy"] > 0.8 and logged[-1]["rows"] == 40 * 32  # throughput in the task's unit
    built = plugin_task.BUILT
    assert torch.equal(built["projection"].weight, built["frozen_before"])  # frozen: bitwise unchanged
    assert not built["projection"].weight.requires_grad
    opt_state = torch.load(ckpt.list_checkpoints(result.run_dir)[0] / "optimizer.bin", weights_only=True)
    assert len(opt_state["state"]) == len(list(built["head"].parameters()))  # no state for the frozen part
    head = json.loads((result.export_dir / "draftforge.json").read_text())
    assert head["task"] == "probe" and head["features"] == 6
    assert (result.export_dir / "probe.safetensors").is_file()
    out = tmp_path / "again"  # `draftforge export` goes through the task's own hook too
    assert cli_main(["export", str(result.run_dir), "--out", str(out)]) == 0
    assert (out / "probe.safetensors").read_bytes() == (result.export_dir / "probe.safetensors").read_bytes()


def test_task_section_is_validated_and_documented(tmp_path, capsys):
    values = probe_recipe(tmp_path)
    values["probe"]["hiden"] = 3
    with pytest.raises(RecipeError, match=r"probe.hiden.*did you mean 'hidden'"):
        recipe_from_dict(values)
    values["probe"] = {"hidden": 0}
    with pytest.raises(RecipeError, match="probe.hidden"):
        recipe_from_dict(values)
    values = probe_recipe(tmp_path)
    values["task"] = "pretrain"
    with pytest.raises(RecipeError, match="section 'probe' belongs to task 'probe'"):
        recipe_from_dict(values)
    with pytest.raises(RecipeError, match="unknown task 'pretrian'.*did you mean 'pretrain'"):
        recipe_from_dict({**probe_recipe(tmp_path), "task": "pretrian"})
    assert cli_main(["train", "--help-recipe", "bogus"]) == 2
    assert "unknown task 'bogus'" in capsys.readouterr().err
    from tests.train import plugin_task  # noqa: F401  (registered: its section is documented)

    assert cli_main(["train", "--help-recipe", "probe"]) == 0
    text = capsys.readouterr().out
    assert "probe.hidden" in text and "width of the classifier's hidden layer" in text and "train.max_steps" in text
    assert cli_main(["train", "--help-recipe", "sft"]) == 0
    assert "probe.hidden" not in capsys.readouterr().out


def _snapshot(root: Path) -> dict:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _tiny(tmp_path, corpus, tokenizer, **train) -> dict:
    from tests.train.test_loop import tiny_recipe

    return tiny_recipe(tmp_path, corpus, tokenizer, **train)


def test_overwrite_keeps_the_old_run_when_the_new_one_cannot_start(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    values = _tiny(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=2, export=True)
    done = run(recipe_from_dict(values))
    before = _snapshot(done.run_dir)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = {**values, "data": {**values["data"], "sources": [str(empty)]}}
    with pytest.raises(DataError, match="have no rows"):
        run(recipe_from_dict(bad), overwrite=True)
    assert _snapshot(done.run_dir) == before
    assert not list(tmp_path.glob(".run.*"))  # nothing left beside it either


def test_overwrite_puts_the_old_run_back_when_the_new_one_fails_before_a_checkpoint(
        tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, monkeypatch):
    values = _tiny(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=2)
    done = run(recipe_from_dict(values))
    before = _snapshot(done.run_dir)
    import draftforge.train.lm as lm

    def diverging(model, batch):
        s, n, m = lm.__dict__["_real_lm_loss"](model, batch)
        return s * float("nan"), n, m

    monkeypatch.setitem(lm.__dict__, "_real_lm_loss", lm.lm_loss)
    monkeypatch.setattr(lm, "lm_loss", diverging)
    from draftforge.train.loop import TrainingDiverged

    with pytest.raises(TrainingDiverged):
        run(recipe_from_dict({**values, "train": {**values["train"], "max_steps": 3}}), overwrite=True)
    assert _snapshot(done.run_dir) == before


def test_a_run_that_fails_on_its_data_writes_nothing(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{not json\n')
    values = _tiny(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir)
    values["data"]["sources"] = [str(bad)]
    with pytest.raises(DataError, match=r"bad\.jsonl:2: malformed JSON"):
        run(recipe_from_dict(values))
    assert not (tmp_path / "run").exists()
    values["data"]["sources"] = [str(tiny_corpus_dir)]  # the corrected rerun is not refused
    assert run(recipe_from_dict({**values, "train": {**values["train"], "max_steps": 1}})).step == 1


def test_killed_before_the_first_checkpoint_resumes_from_step_zero(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir,
                                                                   monkeypatch):
    full = run(recipe_from_dict(_tiny(tmp_path / "a", tiny_corpus_dir, tiny_tokenizer_dir)))
    values = _tiny(tmp_path / "b", tiny_corpus_dir, tiny_tokenizer_dir)
    from draftforge.train.loop import Trainer
    from draftforge.train.rundir import RunDir

    def killed(self, step):  # a SIGKILL: the process ends; nothing gets cleaned up
        raise SystemExit(137)

    with monkeypatch.context() as m:
        m.setattr(Trainer, "save", killed)
        m.setattr(RunDir, "abandon", lambda self: None)
        with pytest.raises(SystemExit):
            run(recipe_from_dict(values))
    with pytest.raises(Exception, match="already holds a run; pass --resume"):
        run(recipe_from_dict(values))
    resumed = run(recipe_from_dict(values), resume=True)
    assert resumed.losses == full.losses  # from step 0 of the same recipe
    assert [r["loss"] for r in read_metrics(resumed.run_dir)] == full.losses


def test_auto_resume_starts_a_run_then_continues_it(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, capsys):
    """One command line for a job's first start and its restarts (a SLURM requeue): --resume refused the first
    start (no run yet) and a plain start refused the restart (a run already there)."""
    full = run(recipe_from_dict(_tiny(tmp_path / "a", tiny_corpus_dir, tiny_tokenizer_dir)))
    part = recipe_from_dict(_tiny(tmp_path / "b", tiny_corpus_dir, tiny_tokenizer_dir))
    run(part, auto_resume=True, stop_after=3)  # the first start, preempted after step 3
    assert "--auto-resume: no run yet in" in capsys.readouterr().out
    resumed = run(part, auto_resume=True)  # the requeued job: the same command
    assert "--auto-resume: continuing the run in" in capsys.readouterr().out
    assert [r["loss"] for r in read_metrics(resumed.run_dir)] == full.losses
    mine = tmp_path / "mine"  # a folder of the user's that holds a recipe.yaml: --resume's refusal, not a takeover
    mine.mkdir()
    (mine / "recipe.yaml").write_text("task: pretrain\n")
    with pytest.raises(CheckpointError, match="is not a run draftforge wrote"):
        run(recipe_from_dict(_tiny(tmp_path / "c", tiny_corpus_dir, tiny_tokenizer_dir) | {"output_dir": str(mine)}),
            auto_resume=True)
    assert (mine / "recipe.yaml").read_text() == "task: pretrain\n" and len(list(mine.iterdir())) == 1
    with pytest.raises(SystemExit):  # argparse: one of --resume, --auto-resume, --overwrite
        cli_main(["train", "x.yaml", "--auto-resume", "--overwrite"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_torn_metrics_line_does_not_stop_resume(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    full = run(recipe_from_dict(_tiny(tmp_path / "a", tiny_corpus_dir, tiny_tokenizer_dir)))
    part = recipe_from_dict(_tiny(tmp_path / "b", tiny_corpus_dir, tiny_tokenizer_dir))
    run(part, stop_after=3)
    with open(Path(part.output_dir) / "metrics.jsonl", "a") as f:
        f.write('{"step": 4, "loss": 6.1')  # a crash mid-append
    run(part, resume=True)
    assert [r["loss"] for r in read_metrics(part.output_dir)] == full.losses
    (Path(part.output_dir) / "metrics.jsonl").write_text('{"step": 1}\n{"step"\n{"step": 3}\n')
    with pytest.raises(CheckpointError, match="line 2 is not JSON"):
        read_metrics(part.output_dir)


def test_checkpoints_and_exports_get_the_usual_permissions(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir):
    old = os.umask(0o022)
    try:
        result = run(recipe_from_dict(_tiny(tmp_path, tiny_corpus_dir, tiny_tokenizer_dir, max_steps=1, export=True)))
    finally:
        os.umask(old)
    last = ckpt.list_checkpoints(result.run_dir)[0]
    paths = [result.export_dir, result.export_dir / "model.safetensors", last, last / "model.safetensors",
             result.run_dir / "recipe.yaml"]
    for p in paths:
        want = 0o755 if p.is_dir() else 0o644
        assert stat.S_IMODE(p.stat().st_mode) == want, p


@pytest.mark.slow
def test_plugin_task_on_two_processes_matches_one(tmp_path):
    from tests import REPO
    from tests.train.test_distributed import _command, _env

    recipe = tmp_path / "probe.yaml"
    # fp32: under bf16 autocast (precision auto on CPUs with native bf16) half a batch rounds differently
    recipe.write_text(yaml.safe_dump(probe_recipe(tmp_path, max_steps=12, log_every=1, precision="fp32")))
    env = _env()  # PYTHONPATH holds the repository root: tests.train.plugin_task imports by name
    losses = {}
    for config in (None, "multi_cpu.yaml"):
        out = tmp_path / f"run-{config}"
        proc = subprocess.run(_command(config, recipe, out), cwd=REPO, env=env, capture_output=True,
                              text=True, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
        assert ("2 process(es)" if config else "1 process(es)") in proc.stdout
        assert (out / "export" / "probe.safetensors").is_file()
        losses[config] = [r["loss"] for r in read_metrics(out)]
    assert losses["multi_cpu.yaml"] == pytest.approx(losses[None], rel=1e-5)


def test_a_task_name_registers_once():
    from draftforge.tasks import BUILT_IN, register_task

    name, builder, config, check, doc = BUILT_IN[1]
    with pytest.raises(ValueError, match="task 'sft' is registered already"):
        register_task(name, builder="my.module:build", doc="another sft")
    register_task(name, builder=builder, config=config, check=check, doc=doc)  # the same registration again


def test_a_keep_best_metric_the_eval_does_not_log_is_refused_before_the_first_step(tmp_path, monkeypatch):
    """It was refused at the first eval, eval_every steps in (20 here; minutes or hours for a real run). The check
    runs one held-out micro-batch with the RNG forked: a metric the eval logs leaves the run's steps as they were."""
    from draftforge.errors import DraftforgeError
    from draftforge.train import loop
    from tests.train import plugin_task

    seen, real = [], loop.Trainer.train_step

    def train_step(self, micro, step):
        seen.append((step, torch.get_rng_state()))
        return real(self, micro, step)

    monkeypatch.setattr(loop.Trainer, "train_step", train_step)
    real_build = plugin_task.build

    def build(recipe, accelerator, with_data=True):  # an eval that draws from torch's RNG (a sampled metric)
        import dataclasses

        spec = real_build(recipe, accelerator, with_data)
        return dataclasses.replace(spec, loss=lambda model, batch: (torch.rand(1), spec.loss(model, batch))[1])

    with pytest.raises(DraftforgeError, match="the eval logs no metric 'acuracy'; it logs: loss, accuracy"):
        loop.train(recipe_from_dict(probe_recipe(tmp_path / "typo", keep_best="acuracy")), build)
    assert seen == []
    plain = loop.train(recipe_from_dict(probe_recipe(tmp_path / "plain", max_steps=2, eval_every=1)), build)
    first_plain = seen[0][1]
    seen.clear()
    kept = loop.train(recipe_from_dict(probe_recipe(tmp_path / "kept", max_steps=2, eval_every=1,
                                                    keep_best="accuracy")), build)
    assert torch.equal(seen[0][1], first_plain) and kept.losses == plain.losses
