"""What a task's builder hands the one loop (docs/design.md §2).

A builder `build(recipe, accelerator, with_data=True) -> TaskSpec` returns:
  model       the trainable module (parts of it that must not train have requires_grad=False);
  loss        loss(model, batch) -> (loss_sum, count, metrics): the loop divides the summed loss of
              the whole global batch by its count, and logs each metric (a summed tensor) the same
              way, as a mean per counted unit;
  count       count(batch) -> tensor: the units `loss` will sum over, known before the forward
              (loss tokens for LM tasks, rows for feature rows), so the gradient is normalised
              over the global batch with one host sync per step;
  frozen      modules the loss uses but never trains (a target, a teacher): the loop moves them to
              the device in eval mode with requires_grad=False and keeps them out of the optimizer,
              out of gradient sync and out of ZeRO / FSDP sharding (they are never `prepare`d);
  train_data / eval_data   datasets of rows with any columns; `collate` turns a dict of column
              lists into tensors (default: torch.tensor per column);
  export      export(model, out_dir, metadata, overwrite=False) -> Path, given the unwrapped trained model;
  unit        what throughput counts ("tokens", "nodes", "rows"); units(batch) counts them;
  run_files   {name: text} the run dir must hold (e.g. a draft vocabulary a later `draftforge export` needs);
  derive_metrics   derive(means) -> {name: value}: numbers that are not a mean per unit (a ratio of two
              metrics, a τ implied by a mean acceptance), computed from the reduced means; distill uses it
              for its held-out acceptance report (a loop that logs eval metrics applies it too).
With with_data=False (`draftforge export`) the builder may skip the data: only model and export are used.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

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


@dataclass
class TaskSpec:
    model: torch.nn.Module
    loss: Callable  # (model, batch) -> (loss_sum, count, metrics dict of summed tensors)
    train_data: Any = None
    eval_data: Any = None
    count: Callable = rows_in
    frozen: dict[str, torch.nn.Module] = field(default_factory=dict)
    collate: Callable = tensor_collate
    export: Callable[..., Path] | None = None  # (model, out_dir, metadata, overwrite=False) -> Path
    tokenizer: Any = None
    unit: str = "rows"
    units: Callable = numel_of_first
    export_metadata: dict = field(default_factory=dict)
    data_stats: dict = field(default_factory=dict)
    run_files: dict[str, str] = field(default_factory=dict)  # written into the run dir when it is claimed
    derive_metrics: Callable[[dict], dict] | None = None  # (metric means) -> derived numbers
