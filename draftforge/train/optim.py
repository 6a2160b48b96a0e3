"""AdamW (no decay on biases and norms) and the warm-up + cosine / linear / constant LR schedule."""

from __future__ import annotations

import math
from typing import Callable

import torch

from draftforge.recipe import Recipe


def build_optimizer(model: torch.nn.Module, recipe: Recipe):
    """AdamW over the trainable parameters only (frozen ones get no optimizer state)."""
    o = recipe.optim
    decay, no_decay = [], []
    for p in model.parameters():
        if p.requires_grad:
            (decay if p.ndim >= 2 else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": o.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # no empty group: DeepSpeed's ZeRO optimizer drops it, and the scheduler, built with one rate per group, then
    # failed its first step (theta's predictor has no 1-D parameters)
    groups = [g for g in groups if g["params"]]
    fused = o.fused if o.fused is not None else _fusable(decay + no_decay)
    opt = torch.optim.AdamW(groups, lr=o.lr, betas=tuple(o.betas), eps=o.eps, fused=fused or None)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(recipe))


def _fusable(params: list[torch.Tensor]) -> bool:
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def lr_lambda(recipe: Recipe) -> Callable[[int], float]:
    o, total = recipe.optim, recipe.train.max_steps

    def factor(step: int) -> float:
        if step < o.warmup_steps:
            return (step + 1) / (o.warmup_steps + 1)
        if o.schedule == "constant":
            return 1.0
        progress = min((step - o.warmup_steps) / max(total - o.warmup_steps, 1), 1.0)
        shape = 0.5 * (1 + math.cos(math.pi * progress)) if o.schedule == "cosine" else 1 - progress
        return o.min_lr_ratio + (1 - o.min_lr_ratio) * shape

    return factor
