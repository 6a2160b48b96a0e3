"""`train.keep_best`: keep the weights of the best eval so far and export those instead of the last step's.

The metric is any number the eval logs (`eval_<name>` in metrics.jsonl): for distill `predicted_speedup` (the
chain τ at γ = 5 over the cost model's round cost, distill.draft_cost / verify_cost), `tau_chain_g5`,
`alpha`, ...; `loss` and the divergences (`kl`, `tvd`, `ce`, `brier` and their per-step forms such as `kl_step0`,
LOWER_IS_BETTER) select by the lowest value, every other metric by the highest. A NaN or infinite value never
becomes the record (a first NaN used to, and then nothing beat it). The weights
live in RUN_DIR/best/ (model.safetensors + best.json, written atomically) and survive a kill.

A resumed run continues from a checkpoint, so it keeps the record as it stood at that checkpoint. A later
record is not the resumed run's to keep: with the same recipe the steps that follow make it again, bitwise the
same; with a changed eval cadence or max_steps they may not, and the record of the checkpoint must not be lost
then. So when a new best replaces the one the last checkpoint saw, that one moves to RUN_DIR/.best-at-checkpoint/
until the next checkpoint is written; a resume takes whichever of the two holds the record at or before its
checkpoint (a kill between the renames leaves one of them).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from draftforge.errors import DraftforgeError
from draftforge.fsutil import atomic_write_text, replace_dir, temp_dir_beside

LOWER_IS_BETTER = ("loss", "kl", "tvd", "ce", "brier", "nll")  # a metric's leading word: smaller is better
BEST_DIR = "best"
RECORD = "best.json"
WEIGHTS = "model.safetensors"
AT_CHECKPOINT_DIR = ".best-at-checkpoint"  # the record the last checkpoint saw, while best/ holds a newer one


class BestKeeper:
    def __init__(self, metric: str | None, run_dir: Path, resumed_step: int, main: bool = True):
        """A resumed run (resumed_step > 0) takes the record its checkpoint saw. `main`: the training run's main
        process, which removes a best/ that holds a later record (another process reading it at the same time
        rejects it all the same); False for a reader such as `draftforge export RUN_DIR`, which changes nothing."""
        self.metric, self.dir, self.record = metric, Path(run_dir) / BEST_DIR, None
        self.at_checkpoint_dir = Path(run_dir) / AT_CHECKPOINT_DIR
        self.record_dir = self.dir  # where the record's weights are (the at-checkpoint copy after a resume)
        self.at_checkpoint = None  # the record the last checkpoint saw (None: none yet)
        if metric and resumed_step > 0:
            for where in (self.dir, self.at_checkpoint_dir):
                record = _read(where)
                if record is not None and record.get("metric") == metric and record.get("step", 0) <= resumed_step:
                    self.record, self.record_dir, self.at_checkpoint = record, where, record
                    break
            if main and self.record_dir == self.at_checkpoint_dir and self.dir.exists():
                shutil.rmtree(self.dir)  # a record of steps the resumed run takes again: not its own

    def value(self, eval_loss: float | None, eval_metrics: dict) -> float | None:
        """This eval's value of the metric (None without an eval); an unknown metric is an error."""
        if not self.metric or eval_loss is None:
            return None
        if self.metric == "loss":
            return eval_loss
        if self.metric not in eval_metrics:
            known = ", ".join(["loss", *sorted(eval_metrics)])
            raise DraftforgeError(f"train.keep_best: the eval logs no metric {self.metric!r}; it logs: {known}")
        return float(eval_metrics[self.metric])

    @property
    def lower_is_better(self) -> bool:
        return bool(self.metric) and self.metric.split("_")[0] in LOWER_IS_BETTER

    def improves(self, value: float | None) -> bool:
        import math

        if value is None or not math.isfinite(value):
            return False
        if self.record is None:
            return True
        best = self.record["value"]
        return value < best if self.lower_is_better else value > best

    def save(self, step: int, value: float, model) -> None:
        """Write the weights of `model` (the full, unwrapped model) and the record; main process only. The record
        the last checkpoint saw, when best/ holds it, moves to .best-at-checkpoint/ first."""
        from safetensors.torch import save_model

        tmp = temp_dir_beside(self.dir, "best")
        save_model(model, str(tmp / WEIGHTS))
        record = {"metric": self.metric, "value": value, "step": step}
        atomic_write_text(tmp / RECORD, json.dumps(record, indent=2) + "\n")
        if self.record is not None and self.record is self.at_checkpoint and self.record_dir == self.dir:
            if self.at_checkpoint_dir.exists():  # a stale copy (a resume took best/'s record)
                shutil.rmtree(self.at_checkpoint_dir)
            self.dir.rename(self.at_checkpoint_dir)
        replace_dir(tmp, self.dir)
        self.note(step, value)

    def note(self, step: int, value: float) -> None:
        """The record of the weights kept at `step` (every process keeps it; only the main one writes them)."""
        self.record = {"metric": self.metric, "value": value, "step": step}
        self.record_dir = self.dir

    def checkpointed(self, main: bool) -> None:
        """A checkpoint was written: the current record is the one a resume from it keeps, in best/ (the main
        process moves an at-checkpoint copy back, or removes one a newer best has made stale)."""
        self.at_checkpoint = self.record
        if main and self.record_dir == self.at_checkpoint_dir:  # no new best since the resume
            replace_dir(self.at_checkpoint_dir, self.dir)
        elif main and self.at_checkpoint_dir.exists():
            shutil.rmtree(self.at_checkpoint_dir)
        self.record_dir = self.dir

    def load_into(self, model) -> dict | None:
        """Put the kept weights into `model` (the full model to export); the record, or None when none is kept."""
        if self.record is None:
            return None
        from safetensors.torch import load_model

        load_model(model, str(self.record_dir / WEIGHTS))
        return dict(self.record)


def _read(where: Path) -> dict | None:
    """A kept record (best.json), or None when there is none to read."""
    try:
        record = json.loads((where / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and (where / WEIGHTS).is_file() else None
