"""What a task's builder hands the one loop (docs/design.md §2): a `TaskSpec`, built whole and frozen.

A builder `build(recipe, accelerator, with_data=True) -> TaskSpec` returns the spec complete; nothing assigns
to it afterwards (a frozen dataclass). A task that specialises another composes: it builds the other's spec and
takes `dataclasses.replace(spec, loss=..., export_metadata={**spec.export_metadata, ...})`, a new value, so the
spec it started from is never changed under anyone who holds it. Its mappings are copied into read-only views
when it is made, so no dict is shared between a spec and the code that built it. With with_data=False
(`draftforge export`) the builder may skip the data: only model, export and export_metadata are used.

Fields:
  model       the trainable module (parts of it that must not train have requires_grad=False);
  loss        loss(model, batch) -> (loss_sum, count, metrics): the loop divides the summed loss of
              the whole global batch by its count, and logs each metric (a summed tensor) the same
              way, as a mean per counted unit; in eval mode (model.training False) it may sum more metrics;
  count       count(batch) -> tensor: the units `loss` will sum over, known before the forward
              (loss tokens for LM tasks, rows for feature rows), so the gradient is normalised
              over the global batch with one host sync per step;
  frozen      modules the loss uses but never trains (a target, a teacher): the loop moves them to
              the device in eval mode with requires_grad=False and keeps them out of the optimizer,
              out of gradient sync and out of ZeRO / FSDP sharding (they are never `prepare`d);
  train_data / eval_data   datasets of rows with any columns; `collate` turns a dict of column
              lists into tensors (default: torch.tensor per column);
  export      export(model, out_dir, metadata, overwrite=False) -> Path, given the unwrapped trained model and
              the whole metadata: call it through `write_export`, which lays export_metadata over the caller's;
  export_metadata   the task's own keys in every export's metadata (a tokenizer fingerprint, a teacher's name);
  unit        what throughput counts ("tokens", "nodes", "rows"); units(batch) counts them;
  run_files   {name: text} the run dir must hold (e.g. a draft vocabulary a later `draftforge export` needs);
  derive_metrics   derive(means) -> {name: value}: numbers that are not a mean per unit (a ratio of two
              metrics, a τ implied by a mean acceptance), computed from the reduced means (train and eval);
  export_report    report(means, count) -> {name: value} added to the export's metrics: at export the loop
              evaluates the weights it writes once more (loop.evaluate_pass, alone on the main process) and
              hands over the eval means with what derive_metrics makes of them, and the units counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

import torch


def tensor_collate(columns: dict[str, list], device) -> dict[str, torch.Tensor]:
    """One tensor per column (rows of equal length), on `device`."""
    return {k: torch.tensor(v, device=device) for k, v in columns.items()}


def rows_in(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The number of rows of a batch (the default count), on the batch's device."""
    first = next(iter(batch.values()))
    return torch.tensor(len(first), device=first.device)


def numel_of_first(batch: dict[str, torch.Tensor]) -> int:
    """Units of a batch for throughput: elements of its first column (tokens for LM blocks)."""
    return next(iter(batch.values())).numel()


_MAPPINGS = ("frozen", "export_metadata", "data_stats", "run_files")


@dataclass(frozen=True)
class TaskSpec:
    model: torch.nn.Module
    loss: Callable  # (model, batch) -> (loss_sum, count, metrics dict of summed tensors)
    train_data: Any = None
    eval_data: Any = None
    count: Callable = rows_in
    frozen: Mapping[str, torch.nn.Module] = field(default_factory=dict)
    collate: Callable = tensor_collate
    export: Callable[..., Path] | None = None  # (model, out_dir, metadata, overwrite=False) -> Path
    tokenizer: Any = None
    unit: str = "rows"
    units: Callable = numel_of_first
    export_metadata: Mapping[str, Any] = field(default_factory=dict)  # laid over the caller's by write_export
    data_stats: Mapping[str, Any] = field(default_factory=dict)
    run_files: Mapping[str, str] = field(default_factory=dict)  # written into the run dir when it is claimed
    derive_metrics: Callable[[dict], dict] | None = None  # (metric means) -> derived numbers
    export_report: Callable[[dict, int], dict] | None = None  # (eval means, units counted) -> export metrics

    def __post_init__(self):
        for name in _MAPPINGS:  # a copy of each, read-only: the builder's dict is not the spec's
            object.__setattr__(self, name, MappingProxyType(dict(getattr(self, name))))

    def write_export(self, model: torch.nn.Module, out_dir, metadata: dict, overwrite: bool = False) -> Path:
        """Export `model` with the caller's metadata (task, target, recipe, metrics) and this task's own keys."""
        if self.export is None:
            raise TypeError("this task has no export")
        return self.export(model, out_dir, {**metadata, **self.export_metadata}, overwrite=overwrite)
