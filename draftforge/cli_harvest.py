"""`draftforge harvest trees|theta|logits|hidden`: training data harvested from a target (+ drafter).

  draftforge harvest trees --target T --drafter D --bench PROMPTS --out DIR [--resume]   # C2T: EAGLE-2 trees
  draftforge harvest theta --target T --drafter D --data ROWS --out DIR [--resume]      # Cali-TS: χ labels
  draftforge harvest logits --target T --data ROWS --out DIR [--resume]                 # distill: top-k teacher
  draftforge harvest hidden --target T --data ROWS --out DIR [--resume]                 # eagle3: states + top-k

Each job's flags are the settings its dataclass declares (draftforge/harvest/: c2t.py, cali_ts.py, logits.py,
hidden.py).
"""

from __future__ import annotations

import argparse
import importlib
import sys

# what -> (module under draftforge.harvest, job class, one-line help)
JOBS = {
    "trees": ("draftforge.harvest.c2t", "TreeHarvestJob",
              "full EAGLE-2 trees (no rerank), one row per node: P, H, d, accepted label (task c2t)"),
    "theta": ("draftforge.harvest.cali_ts", "ThetaHarvestJob",
              "χ labels + hidden states for the Cali-TS θ predictor (task theta)"),
    "logits": ("draftforge.harvest.logits", "LogitsHarvestJob",
               "a target's top-k log-probabilities over token rows, so distill needs no teacher forward "
               "(distill.logits_cache)"),
    "hidden": ("draftforge.harvest.hidden", "HiddenHarvestJob",
               "a target's states at chosen layers (+ its top-k) over token rows, so eagle3 trains without the "
               "target (eagle3.hidden_cache)"),
}


def configure(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="what", metavar="WHAT", required=True)
    for what, (module, _, help_) in JOBS.items():
        sp = sub.add_parser(what, help=help_, formatter_class=argparse.RawDescriptionHelpFormatter)
        importlib.import_module(module).configure(sp)


def run(args) -> int:
    from draftforge.errors import RecipeError
    from draftforge.fsutil import output_problem
    from draftforge.options import values_from_args
    from draftforge.runtime import choose_threads

    module, cls, _ = JOBS[args.what]
    module = importlib.import_module(module)
    job_cls = getattr(module, cls)
    job = job_cls(**values_from_args(args, job_cls))  # every value checked here, before any model loads
    problem = output_problem(job.out, "dir")
    if problem:  # before minutes of model loading and harvesting
        raise RecipeError(f"--out {job.out}: {problem}; give --out a directory for the harvest")
    print(f"[draftforge] {choose_threads(job.threads)}", file=sys.stderr)
    return module.run_job(job)
