"""A throwaway task, written the way a new method would be, that the loop has never seen.

A 2-layer classifier on feature rows (`features`, `label`), with a frozen random projection in
front of it (stands in for a frozen target), its own recipe section `probe:`, a metric (accuracy)
and an export hook that writes only the classifier head. Loaded with `plugins: [tests.train.plugin_task]`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from draftforge.recipe import doc, require
from draftforge.tasks import register_task


BUILT: dict = {}  # the last build's modules, for in-process tests


@dataclass
class ProbeConfig:
    hidden: int = doc(16, "width of the classifier's hidden layer")
    rows: int = doc(256, "synthetic feature rows to train on")
    features: int = doc(6, "features per row")

    def check(self, at: str) -> None:
        require(self.hidden > 0, f"{at}.hidden", "must be > 0")


def make_rows(cfg: ProbeConfig, seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(cfg.rows, cfg.features, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return [{"features": f, "label": int(lab)} for f, lab in zip(x.tolist(), y.tolist())]


def build(recipe, accelerator, with_data: bool = True):
    import datasets

    from draftforge.train.spec import TaskSpec

    cfg = recipe.task_options
    projection = torch.nn.Linear(cfg.features, cfg.features)  # frozen: the "target"
    head = torch.nn.Sequential(torch.nn.Linear(cfg.features, cfg.hidden), torch.nn.ReLU(),
                               torch.nn.Linear(cfg.hidden, 2))
    BUILT.update(projection=projection, head=head, frozen_before=projection.weight.detach().clone())

    def loss(model, batch):
        with torch.no_grad():
            feats = projection(batch["features"])
        logits = model(feats)
        correct = (logits.argmax(-1) == batch["label"]).sum()
        return F.cross_entropy(logits, batch["label"], reduction="sum"), batch["label"].numel(), {"accuracy": correct}

    def export(trained, out_dir, metadata, overwrite=False):
        from safetensors.torch import save_file

        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in trained.state_dict().items()}, str(out_dir / "probe.safetensors"))
        (out_dir / "draftforge.json").write_text(json.dumps({**metadata, "features": cfg.features}))
        return out_dir

    train = eval_ = None
    if with_data:
        rows = make_rows(cfg, recipe.train.seed)
        train, eval_ = datasets.Dataset.from_list(rows[32:]), datasets.Dataset.from_list(rows[:32])
    return TaskSpec(model=head, loss=loss, train_data=train, eval_data=eval_, frozen={"projection": projection},
                    export=export, unit="rows", units=lambda b: len(b["label"]))


register_task("probe", builder=build, config=ProbeConfig, doc="a throwaway classifier on feature rows (tests)")
