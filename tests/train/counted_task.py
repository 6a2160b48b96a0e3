"""A tiny task whose rows count different numbers of units, for checking the loop's loss normalisation by hand.

Row i has K positions of D features, a target per position and a mask of 0..K counted positions (so micro-batches
of one row count different numbers of units); the model is one Linear(D, 1), the loss a masked squared error.
Loaded with `plugins: [tests.train.counted_task]`; `make_rows` lets a test rebuild the rows and the loss in float64.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from draftforge.recipe import doc
from draftforge.tasks import register_task

D, K = 3, 4
BUILT: dict = {}


@dataclass
class CountedConfig:
    rows: int = doc(12, "training rows")


def make_rows(n: int, seed: int = 1) -> list[dict]:
    rng = np.random.default_rng(seed)
    rows = []
    for i in range(n):
        counted = 1 + i % K  # 1..K counted positions, every count present
        rows.append({"x": rng.normal(size=(K, D)).round(3).tolist(), "y": rng.normal(size=K).round(3).tolist(),
                     "m": [1] * counted + [0] * (K - counted), "rid": i})
    return rows


def loss(model, batch):
    x, y, m = batch["x"].float(), batch["y"].float(), batch["m"].float()
    err = (model(x).squeeze(-1) - y) ** 2 * m
    return err.sum(), m.sum(), {}


def build(recipe, accelerator, with_data: bool = True):
    import datasets

    from draftforge.train.spec import TaskSpec

    torch.manual_seed(0)
    model = torch.nn.Linear(D, 1)
    BUILT["model"] = model
    train = datasets.Dataset.from_list(make_rows(recipe.task_options.rows)) if with_data else None
    return TaskSpec(model=model, loss=loss, train_data=train, eval_data=None, count=lambda b: b["m"].sum(),
                    unit="rows", units=lambda b: len(b["rid"]))


register_task("counted", builder=build, config=CountedConfig, doc="masked squared error with unequal counts (tests)")
