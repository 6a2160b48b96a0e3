"""`draftforge train` and `draftforge export`."""

from __future__ import annotations

import argparse
from pathlib import Path

from draftforge.errors import CheckpointError, RecipeError

EPILOG = """examples:
  draftforge train recipes/tiny/pretrain.yaml
  draftforge train recipes/pretrain.yaml --set optim.lr=3e-4 --set train.max_steps=5000
  draftforge train recipes/tiny/pretrain.yaml --resume          # continue from the latest checkpoint
  draftforge train recipes/pretrain.yaml --auto-resume          # continue if output_dir holds the run, else start
  accelerate launch --config_file launch/multi_cpu.yaml -m draftforge train recipes/tiny/pretrain.yaml \
      --set train.micro_batch_size=8                            # 2 processes x 8 = the recipe's global batch 16
  draftforge train --help-recipe pretrain                       # every recipe field with its default and doc

what a run writes in its output_dir (and, while it runs, the lock .NAME.lock beside it):
  recipe.yaml      the recipe as run (--set applied); --resume compares against it
  inputs.json      what the run read (data, init weights, frozen target), checked again on --resume
  metrics.jsonl    one line per logged step and per eval (loss, lr, tokens/s, held-out metrics)
  checkpoints/     step-NNNNNNNN/ every train.save_every steps (train.keep_checkpoints kept) and at the end
  export/          the model in Hugging Face form + draftforge.json, when training ends (train.export): what
                   `eval` reads and `draftforge export` copies out; the best eval's weights with train.keep_best
  best/            train.keep_best's record: the best eval's weights so far and best.json
  logs/            tracker output (tensorboard, ...; train.trackers)
  history.jsonl    each --resume that changed train.max_steps
"""


def configure(p: argparse.ArgumentParser) -> None:
    from draftforge.tasks import get_task, task_names  # light: the registry imports no task

    width = max(len(n) for n in task_names())
    p.epilog = EPILOG + "\ntasks (a recipe's `task:`):\n" + "\n".join(
        f"  {n:<{width}}  {get_task(n).doc}" for n in task_names())
    p.add_argument("recipe", nargs="?", help="YAML recipe (see recipes/ and recipes/tiny/)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. --set optim.lr=3e-4 (repeatable; value parsed as YAML)")
    what = p.add_mutually_exclusive_group()  # both at once silently resumed
    what.add_argument("--resume", action="store_true", help="continue from the latest intact checkpoint of output_dir")
    what.add_argument("--auto-resume", action="store_true",
                      help="continue the run in output_dir if it holds one, else start it: one command line for the "
                           "first start and every restart (a SLURM requeue, a preempted job's rerun)")
    what.add_argument("--overwrite", action="store_true",
                      help="replace the draftforge run in output_dir (a directory marked .draftforge-run, kept until "
                           "the new run's first checkpoint); a folder of other files, a run holding files it did not "
                           "write (your notes beside it), the current directory, its parents, home and / are never "
                           "replaced")
    p.add_argument("--help-recipe", metavar="TASK", nargs="?", const="pretrain",
                   help="print every recipe field of TASK (default pretrain) with its default and doc, and the "
                        "registered tasks, then exit")


def run(args) -> int:
    from draftforge.recipe import load_recipe

    if args.help_recipe:
        print_recipe_help(args.help_recipe)
        return 0
    if not args.recipe:
        raise RecipeError("draftforge train needs a recipe file, e.g. draftforge train recipes/tiny/pretrain.yaml "
                          "(every field: draftforge train --help-recipe TASK)")
    recipe = load_recipe(args.recipe, args.overrides)
    from draftforge.train import run as run_training

    run_training(recipe, resume=args.resume, overwrite=args.overwrite, auto_resume=args.auto_resume)
    return 0


def print_recipe_help(task: str) -> None:
    from draftforge.recipe import task_field_docs
    from draftforge.tasks import get_task, task_names

    rows = task_field_docs(task)  # RecipeError (exit 2) for an unknown task
    print(f"task {task}: {get_task(task).doc}")
    print(f"recipe fields (task {task}); set them in YAML or with --set KEY=VALUE\n")
    width = max(len(k) for k, _, _ in rows)
    for key, default, text in rows:
        print(f"  {key:<{width}}  {text}  [default: {default}]")
    print("\nregistered tasks:")
    for name in task_names():
        print(f"  {name:<10} {get_task(name).doc}")


def configure_export(p: argparse.ArgumentParser) -> None:
    p.add_argument("run_dir", help="a draftforge run directory (holds recipe.yaml and checkpoints/)")
    p.add_argument("--out", required=True, help="where to write model.safetensors, config.json, tokenizer, "
                                                 "draftforge.json")
    p.add_argument("--checkpoint", help="a specific checkpoint dir (default: the latest intact one, or for a run "
                                        "with train.keep_best the best eval's weights in RUN_DIR/best)")
    p.add_argument("--last", action="store_true", help="a train.keep_best run: export the latest checkpoint's "
                                                       "weights instead of the best eval's")
    p.add_argument("--overwrite", action="store_true", help="replace an existing export at --out")


def run_export(args) -> int:
    from draftforge.train.export_run import export_checkpoint

    from draftforge.fsutil import output_problem

    run_dir = Path(args.run_dir)
    if not (run_dir / "recipe.yaml").is_file():
        hint = ("; it is an export itself: give the run directory it was exported from"
                if (run_dir / "draftforge.json").is_file() else "")
        raise CheckpointError(f"{run_dir} is not a draftforge run directory (no recipe.yaml){hint}")
    if args.out is not None:
        problem = output_problem(args.out, "dir")
        if problem:
            raise CheckpointError(f"--out {args.out}: {problem}; give --out a writable directory")
    out = export_checkpoint(run_dir, Path(args.out), checkpoint=args.checkpoint, overwrite=args.overwrite,
                            last=args.last)
    print(f"exported {run_dir} -> {out}")
    return 0
