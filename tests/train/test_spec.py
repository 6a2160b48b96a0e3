"""TaskSpec is built whole: a frozen value whose mappings are its own copies; and the loop's one eval pass gives
distill's acceptance numbers (train logs and the export's held-out report alike), checked against a hand
computation on a tiny lookup-table student and teacher."""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from types import SimpleNamespace

import pytest
import torch

from draftforge.train import distill
from draftforge.train.divergences import derive_acceptance
from draftforge.train.loop import evaluate, evaluate_pass
from draftforge.train.spec import TaskSpec


def _loss(model, batch):
    return torch.zeros(()), torch.tensor(1), {}


def test_a_spec_cannot_be_assigned_to_and_owns_its_mappings():
    meta, frozen = {"tokenizer_fingerprint": "abc"}, {"teacher": torch.nn.Linear(2, 2)}
    spec = TaskSpec(model=torch.nn.Linear(2, 2), loss=_loss, export_metadata=meta, frozen=frozen)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.loss = _loss
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.export_metadata = {}
    with pytest.raises(TypeError):
        spec.export_metadata["distilled_from"] = "x"  # read-only
    meta["distilled_from"] = "x"  # the builder's dict is not the spec's
    frozen["other"] = torch.nn.Linear(2, 2)
    assert dict(spec.export_metadata) == {"tokenizer_fingerprint": "abc"} and list(spec.frozen) == ["teacher"]
    derived = dataclasses.replace(spec, export_metadata={**spec.export_metadata, "distilled_from": "t"})
    assert "distilled_from" in derived.export_metadata and "distilled_from" not in spec.export_metadata


def test_write_export_lays_the_tasks_keys_over_the_callers(tmp_path):
    seen = {}

    def export(model, out_dir, metadata, overwrite=False):
        seen.update(metadata)
        return out_dir

    spec = TaskSpec(model=torch.nn.Linear(2, 2), loss=_loss, export=export, export_metadata={"k": 1, "task": "mine"})
    assert spec.write_export(spec.model, tmp_path, {"task": "distill", "metrics": {}}) == tmp_path
    assert seen == {"task": "mine", "metrics": {}, "k": 1}


# ---------------------------------------------------------------- acceptance from the loop's eval, by hand

V = 4
STUDENT = [[2.0, 0.5, -1.0, 0.0], [0.0, 1.5, 0.3, -0.5], [-1.0, 0.2, 2.5, 0.1], [0.4, 0.4, 0.0, 1.0]]
TEACHER = [[1.0, 1.2, -0.5, 0.0], [0.3, 2.0, 0.0, 0.1], [0.5, -0.3, 1.0, 0.8], [-0.2, 0.0, 0.3, 2.2]]
ROWS = {  # the third row lies beyond eval_batches x micro_batch_size: never counted
    "input_ids": [[0, 1, 2, 3, 1, 0, 2, 3], [3, 2, 1, 0, 0, 1, 3, 2], [1, 1, 1, 1, 1, 1, 1, 1]],
    "labels": [[0, 1, 2, 3, 1, 0, 2, 3], [3, -100, 1, 0, 0, 1, 3, 2], [1, 1, 1, 1, 1, 1, 1, 1]],
}


class Lookup(torch.nn.Module):
    """logits of a position = a fixed row chosen by its input id (a bigram table)."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(torch.tensor(table))

    def forward(self, input_ids):
        return SimpleNamespace(logits=self.table[input_ids])


def _softmax(xs):
    z = sum(math.exp(x) for x in xs)
    return [math.exp(x) / z for x in xs]


def _by_hand(rows: int = 2, gamma: int = 5, cost=(0.1, 1.2)) -> dict:
    alpha, agree, kl, keep = [], [], [], []
    for ids, labels in zip(ROWS["input_ids"][:rows], ROWS["labels"][:rows]):
        a_row, g_row, k_row = [], [], []
        for t, x in enumerate(ids):
            p, q = _softmax(TEACHER[x]), _softmax(STUDENT[x])
            kept = t + 1 < len(ids) and labels[t + 1] != -100
            k_row.append(kept)
            a_row.append(sum(map(min, p, q)) if kept else 0.0)
            g_row.append(float(p.index(max(p)) == q.index(max(q))) if kept else 0.0)
            if kept:
                kl.append(sum(pi * math.log(pi / qi) for pi, qi in zip(p, q)))
        alpha.append(a_row), agree.append(g_row), keep.append(k_row)
    positions = sum(map(sum, keep))
    kept_alpha = [a for ar, kr in zip(alpha, keep) for a, k in zip(ar, kr) if k]
    kept_agree = [g for gr, kr in zip(agree, keep) for g, k in zip(gr, kr) if k]
    out = {"alpha": sum(kept_alpha) / positions, "top1_agree": sum(kept_agree) / positions, "kl": sum(kl) / positions}
    anchors = [(r, a) for r in range(rows) for a in range(len(keep[r]) - gamma + 1) if all(keep[r][a:a + gamma])]
    for name, values in (("alpha", alpha), ("greedy", agree)):
        chain = [len(anchors)]
        for d in range(1, gamma + 1):
            chain.append(sum(math.prod(values[r][a:a + d]) for r, a in anchors))
            out[f"{name}_depth{d}"] = chain[d] / chain[d - 1] if chain[d - 1] > 0 else 0.0
        out["tau_chain_g5" + ("" if name == "alpha" else "_greedy")] = 1 + sum(c / len(anchors) for c in chain[1:])
    for key, value in (("", out["alpha"]), ("_greedy", out["top1_agree"])):
        out[f"tau_g5{key}"] = (1 - value ** (gamma + 1)) / (1 - value)
        out[f"predicted_speedup{key}"] = out[f"tau_chain_g5{key}"] / (gamma * cost[0] + cost[1])
    return {**out, "positions": positions, "anchors": len(anchors)}


def test_the_loops_eval_gives_the_acceptance_a_hand_computation_gives(capsys):
    import datasets
    from accelerate import Accelerator

    expected = _by_hand()
    assert expected["positions"] == 13 and expected["anchors"] == 5  # row 2: no loss at its first position
    spec = TaskSpec(model=Lookup(STUDENT), loss=distill.make_loss(Lookup(TEACHER), distill.DistillConfig()),
                    eval_data=datasets.Dataset.from_dict(ROWS),
                    derive_metrics=partial(derive_acceptance, cost=(0.1, 1.2)), export_report=distill.acceptance_report)
    t, acc = SimpleNamespace(eval_batches=2, micro_batch_size=1), Accelerator(cpu=True)
    logged = {}
    loss = evaluate(spec.model, spec, acc, t, logged)  # the loop's evals: fp32 sums on the device
    assert loss == pytest.approx(expected["kl"], rel=1e-5)  # loss kl, weight 1, T=1
    alone = evaluate_pass(spec.model, spec, acc, t, alone=True)  # the export's: fp64 sums on the host
    assert alone.count == expected["positions"] and alone.loss == pytest.approx(loss, rel=1e-6)
    report = spec.export_report(alone.metrics, int(alone.count))["acceptance"]
    assert "[draftforge] distill: held-out acceptance" in capsys.readouterr().out
    for key in ("alpha", "top1_agree", "kl", "tau_g5", "tau_g5_greedy", "tau_chain_g5", "tau_chain_g5_greedy",
                "predicted_speedup", "predicted_speedup_greedy",
                *(f"{name}_depth{d}" for name in ("alpha", "greedy") for d in range(1, 6))):
        assert logged[key] == pytest.approx(expected[key], rel=1e-5, abs=1e-7), key
        assert report[key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), key
    assert report["positions"] == expected["positions"] and not any(k.startswith("chain_") for k in report)


def test_the_eval_pass_builds_no_autograd_graph():
    """The loop's evals and the export's report run every micro-batch's loss with autograd off: a graph kept alive
    by the running sums grew an EAGLE-3 eval past 24 GiB."""
    import datasets
    from accelerate import Accelerator

    seen = []

    def loss(model, batch):
        seen.append(torch.is_grad_enabled())
        out = model(torch.ones(1, 2)).sum()
        return out, torch.tensor(1), {"m": out}

    spec = TaskSpec(model=torch.nn.Linear(2, 2), loss=loss, collate=lambda rows, device: rows,
                    eval_data=datasets.Dataset.from_dict({"x": [0, 1, 2]}))
    t, acc = SimpleNamespace(eval_batches=3, micro_batch_size=1), Accelerator(cpu=True)
    assert evaluate(spec.model, spec, acc, t) is not None and evaluate_pass(spec.model, spec, acc, t, alone=True)
    assert seen == [False] * 6 and torch.is_grad_enabled()
