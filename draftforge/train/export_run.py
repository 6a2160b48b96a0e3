"""`draftforge export RUN_DIR --out DIR`: turn a run's checkpoint into an exported checkpoint.

The model is rebuilt from the run's own recipe (no data is read), its weights are loaded from
the checkpoint's safetensors, and it is written with `draftforge.export.export_model`. A run with
`train.keep_best` exports the kept weights (RUN_DIR/best/), as the run's own export at the end of training
does, unless a checkpoint is named or `last=True`.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import yaml

from draftforge.errors import CheckpointError, first_line
from draftforge.fsutil import read_safetensors
from draftforge.train import checkpoint as ckpt
from draftforge.train.best import BestKeeper


def export_checkpoint(run_dir: Path, out: Path, *, checkpoint: str | None = None, overwrite: bool = False,
                      last: bool = False, say=print) -> Path:
    from draftforge.recipe import recipe_from_dict
    from draftforge.train import task_builder
    from draftforge.train.distributed import load_fitting_state

    if checkpoint and not Path(checkpoint).is_dir():  # not "manifest.json is missing" about a path that is not there
        raise CheckpointError(f"--checkpoint {checkpoint} is not a directory; give one of {run_dir}/checkpoints/step-*, "
                              "or leave --checkpoint out to export the latest intact one")
    recipe = recipe_from_dict(yaml.safe_load((run_dir / "recipe.yaml").read_text()))
    # the run is where it is now: a moved or copied run's recipe still names where it trained, and the builder
    # reads the run's own files (its draft_vocab.json) from output_dir, which may hold another run's by now
    recipe = dataclasses.replace(recipe, output_dir=str(run_dir))
    _check_inputs_unchanged(run_dir, recipe)
    src = Path(checkpoint) if checkpoint else _latest_checkpoint(run_dir)
    problem = ckpt.verify(src)
    if problem:
        raise CheckpointError(f"checkpoint {src} is unusable: {problem}")
    weights = src / "model.safetensors"
    if not weights.is_file():
        raise CheckpointError(f"{src} holds no model.safetensors (sharded FSDP/ZeRO-3 state is consolidated by "
                              "the run's own export at the end of training)")
    from draftforge.export import check_not_foreign

    check_not_foreign(Path(out))  # before the task's model (and a distill or EESD target) loads
    spec = task_builder(recipe.task)(recipe, _NoAccelerator(), with_data=False)  # the task's own model + export
    # An untied lm_head missing from the file is an error, not a silently random output head.
    load_fitting_state(spec.model, read_safetensors(weights, f"export another checkpoint of {run_dir} (--checkpoint)"),
                       str(weights))
    state = ckpt.read_loop_state(src)
    if checkpoint:  # another run's checkpoint went out labelled as this run's task, recipe and metrics
        from draftforge.train.rundir import EXTENSIBLE_KEYS

        theirs = state.get("recipe")
        differ = [k for k in ckpt.recipe_differences(theirs, recipe.to_dict()) if k not in EXTENSIBLE_KEYS] \
            if isinstance(theirs, dict) else []
        if differ:
            raise CheckpointError(f"--checkpoint {src} was written by another run (its recipe differs from "
                                  f"{run_dir}'s in {', '.join(differ[:6])}{' ...' if len(differ) > 6 else ''}); "
                                  f"export it from its own run: draftforge export {src.parent.parent}")
    metrics = _final_metrics(run_dir, state["step"])
    # train.keep_best: the kept weights (the record at or before this checkpoint, in RUN_DIR/best or the copy the
    # checkpoint saw), as the run's own export; read only (main=False: the run dir is left as it is)
    metric = None if checkpoint or last else recipe.train.keep_best
    kept = _kept(run_dir, metric, state["step"], spec.model) if metric else None
    if kept is not None:
        metrics = kept_metrics(run_dir, metrics, kept)
        say(f"exporting the weights of step {kept['step']}, the best {kept['metric']} ({kept['value']:.4g}; "
            f"train.keep_best), not {src.name}'s (--last exports those)")
    meta = {"task": recipe.task, "target": recipe.model.target, "recipe": recipe.to_dict(), "metrics": metrics,
            "checkpoint": src.name}
    meta = _with_the_runs_own(run_dir, meta, kept["step"] if kept else state["step"])
    return spec.write_export(spec.model, out, meta, overwrite=overwrite)


RUN_KEYS = ("data_stats", "distilled_from", "logits_cache", "harvest")  # facts of the run, whatever its weights
WEIGHT_KEYS = ("heldout",)  # a report on the exported weights (C2T's held-out recall per β)


def _with_the_runs_own(run_dir: Path, meta: dict, step: int) -> dict:
    """`meta` with what the run's own export recorded and a rebuild without the training data cannot: the data's
    stats and a teacher's name always; reports on the weights (metrics.acceptance, C2T's held-out figures) where
    it exported the weights of the same step. A builder's own keys still win (write_export lays them over)."""
    import json

    try:
        own = json.loads((Path(run_dir) / "export" / "draftforge.json").read_text())
    except (OSError, ValueError, UnicodeDecodeError):
        return meta
    if not isinstance(own, dict) or own.get("task") != meta["task"]:
        return meta
    out = {**{k: own[k] for k in RUN_KEYS if k in own}, **meta}
    theirs = own.get("metrics") if isinstance(own.get("metrics"), dict) else {}
    own_step = (theirs.get("kept") or {}).get("step", theirs.get("steps"))
    if own_step == step:
        out.update({k: own[k] for k in WEIGHT_KEYS if k in own and k not in meta})
        out["metrics"] = {**{k: v for k, v in theirs.items() if k not in meta["metrics"]}, **meta["metrics"]}
    return out


class _NoAccelerator:
    """What a builder may touch of the accelerator when no training runs (export of a finished run)."""

    num_processes, process_index, is_main_process = 1, 0, True
    device = "cpu"

    def print(self, *args, **kwargs):
        print(*args, **kwargs)

    def main_process_first(self):
        import contextlib

        return contextlib.nullcontext()


def _latest_checkpoint(run_dir: Path) -> Path:
    """The newest intact checkpoint, with advice for `export` (latest_valid's own speaks of --resume)."""
    where = Path(run_dir) / "checkpoints"
    done = (Path(run_dir) / "export" / "config.json").is_file()
    hint = (f"the run's own export is in {Path(run_dir) / 'export'}" if done else
            "train until a checkpoint is saved (every train.save_every steps, and at the end) and export again")
    if not ckpt.list_checkpoints(run_dir):
        raise CheckpointError(f"{run_dir} has no checkpoint to export yet (nothing in {where}); {hint}")
    try:
        return ckpt.latest_valid(run_dir)
    except CheckpointError:
        hint = hint if done else "train the run again (draftforge train RECIPE --overwrite)"
        raise CheckpointError(f"every checkpoint in {where} is corrupted, so there is nothing to export; "
                              f"{hint}") from None


TARGET_BOUND = ("eesd", "eagle3", "theta")  # tasks whose export describes its target (and θ's its harvest)


def _check_inputs_unchanged(run_dir: Path, recipe) -> None:
    """Some exports describe the inputs they were trained against: the target (an exit head's frozen-trunk
    fingerprint, an EAGLE-3 head's target config) and, for a θ predictor, the harvest (its target / drafter pairing
    and θ̂₀). Rebuilt from files that changed since, that metadata would name the wrong pair; such an export is
    refused. (An LM drafter's export names its target only: it is checked against a target by its tokenizer.)"""
    from draftforge.train.rundir import INPUTS_FILE, changed_inputs

    if recipe.task not in TARGET_BOUND:
        return
    read = ("model.target", *(("data.sources",) if recipe.task == "theta" else ()))
    changed = [k for k in changed_inputs(run_dir, recipe, "export") if k.split(" ")[0] in read]
    if changed:
        own = Path(run_dir) / "export"
        raise CheckpointError(f"{'; '.join(changed)} changed since {run_dir} trained ({INPUTS_FILE} records what it "
                              "read), and the export would describe what is there now; "
                              + (f"the run's own export in {own} was written with what it trained on"
                                 if (own / "draftforge.json").is_file() or (own / "theta.safetensors").is_file()
                                 else "put back what it trained on, or train again"))


def _kept(run_dir: Path, metric: str, step: int, model) -> dict | None:
    """train.keep_best's record at or before `step`, its weights put into `model`; None where there is none. A
    record that cannot be read is an error: exporting the last weights under a keep_best recipe would pass them off
    as the best (it did, silently)."""
    from draftforge.train.best import AT_CHECKPOINT_DIR, BEST_DIR, RECORD, _read

    for where in (run_dir / BEST_DIR, run_dir / AT_CHECKPOINT_DIR):
        if (where / RECORD).exists() and _read(where) is None:
            raise CheckpointError(f"train.keep_best: {where / RECORD} cannot be read (or its weights are missing), so "
                                  f"the best weights are unknown; `draftforge export {run_dir} --last` exports the "
                                  "last checkpoint's")
    try:
        return BestKeeper(metric, run_dir, step, main=False).load_into(model)
    except Exception as err:  # a damaged best/model.safetensors
        raise CheckpointError(f"train.keep_best: the kept weights in {run_dir / BEST_DIR} cannot be read "
                              f"({first_line(err)}); "
                              f"`draftforge export {run_dir} --last` exports the last checkpoint's") from None


def kept_metrics(run_dir: Path, last: dict, kept: dict) -> dict:
    """An export of train.keep_best's weights: its steps / final_loss / eval_loss are the kept step's (the weights'
    own; they were the last step's), the last step's in `last_step`, and the record in `kept`."""
    at = _final_metrics(run_dir, kept["step"])
    return {**last, **at, "kept": kept, "last_step": {k: last.get(k) for k in ("steps", "final_loss", "eval_loss")}}


def _final_metrics(run_dir: Path, step: int) -> dict:
    from draftforge.train.metrics_log import read_metrics

    rows = [r for r in read_metrics(run_dir) if r["step"] <= step]
    out = {"steps": step}
    if rows:
        trained = [r for r in rows if "loss" in r]  # an eval-only record (step 0, a stream's last eval) has none
        out["final_loss"] = trained[-1]["loss"] if trained else None
        evals = [r["eval_loss"] for r in rows if "eval_loss" in r]
        out["eval_loss"] = evals[-1] if evals else None
    return out
