"""The loop's arithmetic against hand computations in float64, not against other runs of the same code.

Oracles (docs/training.md, draftforge/train/batches.py, recipe docs of `optim`): step s reads global rows
[s*G, (s+1)*G) of a stream that walks the data in the permutation `np.random.default_rng([seed, epoch])` draws
each epoch; a step's loss is the sum of per-unit losses over the whole global batch divided by the global batch's
count (TaskSpec.loss returns (loss_sum, count, metrics); "the loop normalises by the global batch's count"); the
learning rate warms up linearly over `warmup_steps`, then follows a cosine / linear decay from the peak to
`min_lr_ratio` x peak at `max_steps` (or stays at the peak: `constant`).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from draftforge.recipe import recipe_from_dict
from draftforge.train import loop
from draftforge.train.loop import read_metrics
from tests.train import counted_task

SEED, PEAK = 5, 0.1


@pytest.fixture(autouse=True)
def fresh_accelerator_state():
    """These runs train in fp32; a run in another precision before or after them in the same process (precision
    auto on a CPU with native bf16) would find Accelerate's process-wide state refusing it: cleared on both sides."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def counted_recipe(tmp_path, optim=None, **train) -> dict:
    return {
        "task": "counted", "plugins": ["tests.train.counted_task"], "output_dir": str(tmp_path / "run"),
        "model": {"tokenizer": "unused"}, "data": {"sources": ["synthetic"]}, "counted": {"rows": 12},
        "optim": {"lr": PEAK, "warmup_steps": 0, "schedule": "constant", "grad_clip": 0.0, "weight_decay": 0.0,
                  **(optim or {})},
        "train": {"max_steps": 6, "global_batch_size": 4, "micro_batch_size": 1, "block_size": 1, "eval_every": 0,
                  "save_every": 0, "log_every": 1, "trackers": [], "export": False, "precision": "fp32",
                  "seed": SEED, **train},
    }


def record_optimizer_steps(monkeypatch) -> list[dict]:
    """At each optimizer step: the rate of every group, and the parameters and gradients it steps from."""
    steps, real = [], loop.build_optimizer

    def build(model, recipe):
        opt, sched = real(model, recipe)

        def pre(o, args, kwargs):
            params = [p for g in o.param_groups for p in g["params"]]
            steps.append({"lr": [g["lr"] for g in o.param_groups],
                          "params": [p.detach().double().clone() for p in params],
                          "grads": [p.grad.detach().double().clone() for p in params]})
        opt.register_step_pre_hook(pre)
        return opt, sched

    monkeypatch.setattr(loop, "build_optimizer", build)
    return steps


def documented_rows(step: int, G: int, n: int, seed: int) -> list[int]:
    """Row ids of global positions [step*G, (step+1)*G): a fresh seeded permutation of the n rows each epoch."""
    return [int(np.random.default_rng([seed, e]).permutation(n)[i])
            for e, i in (divmod(pos, n) for pos in range(step * G, (step + 1) * G))]


def hand_loss_and_grads(rows: list[dict], weight: torch.Tensor, bias: torch.Tensor):
    """Sum of the masked squared errors of all the rows over their total count, and its gradient (float64)."""
    w, b = weight.clone().requires_grad_(True), bias.clone().requires_grad_(True)
    total, count = torch.zeros((), dtype=torch.float64), 0
    for r in rows:
        x, y, m = (torch.tensor(r[k], dtype=torch.float64) for k in ("x", "y", "m"))
        total = total + (((x @ w[0] + b[0] - y) ** 2) * m).sum()
        count += sum(r["m"])
    (total / count).backward()
    return (total / count).item(), w.grad, b.grad


@pytest.mark.parametrize("micro", [1, 2])
def test_each_steps_gradient_is_the_global_batch_mean_over_counted_units(tmp_path, monkeypatch, micro):
    steps = record_optimizer_steps(monkeypatch)
    G, n, max_steps = 4, 12, 6  # 6 steps x 4 rows cross an epoch edge
    result = loop.train(recipe_from_dict(counted_recipe(tmp_path, max_steps=max_steps, micro_batch_size=micro)),
                        counted_task.build)
    assert len(steps) == max_steps
    rows = counted_task.make_rows(n)
    logged = {r["step"]: r["loss"] for r in read_metrics(result.run_dir) if "loss" in r}
    unequal = 0  # steps whose micro-batches count different numbers of units: where the normalisation shows
    for s, rec in enumerate(steps):
        batch = [rows[i] for i in documented_rows(s, G, n, SEED)]
        unequal += len({sum(sum(r["m"]) for r in batch[a:a + micro]) for a in range(0, G, micro)}) > 1
        weight, bias = rec["params"]
        hand, g_w, g_b = hand_loss_and_grads(batch, weight, bias)
        assert torch.allclose(rec["grads"][0], g_w, rtol=1e-5, atol=1e-6), \
            f"step {s + 1}: weight gradient {rec['grads'][0].tolist()} != hand global mean {g_w.tolist()}"
        assert torch.allclose(rec["grads"][1], g_b, rtol=1e-5, atol=1e-6), \
            f"step {s + 1}: bias gradient {rec['grads'][1].tolist()} != hand global mean {g_b.tolist()}"
        assert logged[s + 1] == pytest.approx(hand, rel=1e-5), f"step {s + 1}: logged loss"
    assert unequal >= max_steps // 2, "the rows should give micro-batches of unequal counts"


def hand_rate(k: int, warmup: int, total: int, schedule: str, min_ratio: float) -> float:
    """Rate of step k (0-based). Warm-up: a linear ramp from 0 that reaches the peak at step `warmup` (the first
    step after it), so step k < warmup runs at peak*(k+1)/(warmup+1); then the decay from the peak at step
    `warmup` to min_ratio*peak at step `total` (the step after the last one)."""
    if k < warmup:
        return PEAK * (k + 1) / (warmup + 1)
    progress = (k - warmup) / (total - warmup)
    shape = {"cosine": 0.5 * (1 + math.cos(math.pi * progress)), "linear": 1 - progress, "constant": 1.0}[schedule]
    return PEAK * (min_ratio + (1 - min_ratio) * shape) if schedule != "constant" else PEAK


@pytest.mark.parametrize("schedule", ["cosine", "linear", "constant"])
def test_learning_rate_of_every_step_follows_the_documented_warm_up_and_decay(tmp_path, monkeypatch, schedule):
    steps = record_optimizer_steps(monkeypatch)
    warmup, total, min_ratio = 3, 10, 0.2
    result = loop.train(recipe_from_dict(counted_recipe(
        tmp_path, optim={"warmup_steps": warmup, "schedule": schedule, "min_lr_ratio": min_ratio},
        max_steps=total, global_batch_size=2, micro_batch_size=1)), counted_task.build)
    got = [rec["lr"] for rec in steps]
    want = [hand_rate(k, warmup, total, schedule, min_ratio) for k in range(total)]
    assert len(got) == total
    for k, (rates, expected) in enumerate(zip(got, want)):
        assert rates == pytest.approx([expected] * len(rates), rel=1e-12), \
            f"step {k + 1}: lr {rates} != hand {expected}"
    ramp = want[:warmup + 1]  # linear from 0: equal increments, the first one the size of the first rate
    assert all(b - a == pytest.approx(ramp[0]) for a, b in zip(ramp, ramp[1:])) and ramp[-1] == pytest.approx(PEAK)
    logged = [r["lr"] for r in read_metrics(result.run_dir) if "lr" in r]
    assert logged == pytest.approx(want, rel=1e-6)


def test_a_run_that_ends_after_its_first_step_reports_that_steps_pace(tmp_path, capsys):
    """The first step of a run is left out of the pace (warm-up costs) unless it is the last: a run that stopped
    after it (a stream of one global batch, a stop) reported 0 rows/s. Its own step is the only pace there is."""
    result = loop.train(recipe_from_dict(counted_recipe(tmp_path, max_steps=6)), counted_task.build, stop_after=1)
    assert result.step == 1 and result.tokens_per_s > 0
    assert " 0 rows/s" not in capsys.readouterr().out
