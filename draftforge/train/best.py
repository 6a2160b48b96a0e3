"""`train.keep_best`: keep the weights of the best eval so far and export those instead of the last step's.

The metric is any number the eval logs (`eval_<name>` in metrics.jsonl): for distill `predicted_speedup` (the
chain τ at γ = 5 over the cost model's round cost, distill.draft_cost / verify_cost), `tau_chain_g5`,
`alpha`, ...; `loss` and the divergences (`kl`, `tvd`, `ce`, `brier` and their per-step forms such as `kl_step0`,
LOWER_IS_BETTER) select by the lowest value, every other metric by the highest. A NaN or infinite value never
becomes the record (a first NaN used to, and then nothing beat it). The weights
live in RUN_DIR/best/ (model.safetensors + best.json, written atomically) and survive a kill: a resumed run
keeps the record when it was made at or before the checkpoint it resumes from (a later one is made again,
bitwise the same, by the steps that follow).
"""

from __future__ import annotations

import json
from pathlib import Path

from draftforge.errors import DraftforgeError
from draftforge.fsutil import atomic_write_text, replace_dir, temp_dir_beside

LOWER_IS_BETTER = ("loss", "kl", "tvd", "ce", "brier", "nll")  # a metric's leading word: smaller is better
BEST_DIR = "best"
RECORD = "best.json"
WEIGHTS = "model.safetensors"


class BestKeeper:
    def __init__(self, metric: str | None, run_dir: Path, resumed_step: int):
        self.metric, self.dir, self.record = metric, Path(run_dir) / BEST_DIR, None
        if metric and resumed_step > 0 and (self.dir / RECORD).is_file():
            record = json.loads((self.dir / RECORD).read_text())
            if record.get("metric") == metric and record.get("step", 0) <= resumed_step:
                self.record = record

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
        """Write the weights of `model` (the full, unwrapped model) and the record; main process only."""
        from safetensors.torch import save_model

        tmp = temp_dir_beside(self.dir, "best")
        save_model(model, str(tmp / WEIGHTS))
        record = {"metric": self.metric, "value": value, "step": step}
        atomic_write_text(tmp / RECORD, json.dumps(record, indent=2) + "\n")
        replace_dir(tmp, self.dir)
        self.note(step, value)

    def note(self, step: int, value: float) -> None:
        """The record of the weights kept at `step` (every process keeps it; only the main one writes them)."""
        self.record = {"metric": self.metric, "value": value, "step": step}

    def load_into(self, model) -> dict | None:
        """Put the kept weights into `model` (the full model to export); the record, or None when none is kept."""
        if self.record is None:
            return None
        from safetensors.torch import load_model

        load_model(model, str(self.dir / WEIGHTS))
        return dict(self.record)
