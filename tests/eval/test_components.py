"""Memory of the target and the drafter apart (eval/components.py). Oracles: buffers of known size allocated
inside a fake target's and drafter's calls (resident once written), cache sizes the fakes report, and parameter
bytes counted by hand."""

from __future__ import annotations

import json

import pytest
import torch

from draftforge.eval import components
from draftforge.eval.metrics import reset_rss_high_water_mark

MiB = 2**20
can_meter = pytest.mark.skipif(not reset_rss_high_water_mark(), reason="needs Linux's resettable VmHWM")


def touch(mib: int) -> torch.Tensor:
    return torch.ones(mib * MiB // 4)  # written, so resident


class FakeTarget:
    def __init__(self, verify_mib):
        self.model = torch.nn.Linear(10, 10)  # 100 weights + 10 biases, fp32: 440 bytes
        self.verify_mib, self.held = verify_mib, 0

    def cache_bytes(self):
        return self.held

    def prefill(self, seq):
        self.held = 1000 * len(seq)

    def verify(self, last, tree):
        scratch = touch(self.verify_mib)
        return scratch[:1]

    def commit(self, path):
        self.held += 1000 * (len(path) + 1)


class FakeDrafter:
    def __init__(self, draft_mib):
        self.draft_mib = draft_mib

    def cache_bytes(self):
        return 512

    def begin(self, seq):
        return touch(self.draft_mib)[:1]

    def draft(self, seq, plan, params, generator):
        self.begin(seq)  # a nested call: part of this one
        return None

    def accept(self, path):
        pass


def decode(target, drafter, rounds=3):
    target.prefill([1] * 10)
    for _ in range(rounds):
        if drafter is not None:
            drafter.draft([], None, None, None)
        target.verify(0, None)
        target.commit([0, 1])
        if drafter is not None:
            drafter.accept([0, 1])


@can_meter
def test_each_component_is_charged_its_own_calls_memory():
    """The target's verify takes 48 MiB, the drafter's draft 8 MiB (in a nested call): each component's working
    memory is its own buffer (+ < 8 MiB of allocator slack), not the other's; calls and state as the fakes did."""
    target, drafter = FakeTarget(48), FakeDrafter(8)
    found = components.measure(lambda: decode(target, drafter), target, drafter)
    t, d = found["target"], found["drafter"]
    assert 48 * MiB <= t["working_bytes"] < 56 * MiB
    assert 8 * MiB <= d["working_bytes"] < 16 * MiB
    assert t["calls"] == 1 + 3 + 3 and d["calls"] == 3 + 3  # the nested begin() is not counted apart
    assert t["state_bytes"] == 10_000 + 3 * 3000 and d["state_bytes"] == 512
    assert t["weights_bytes"] == 440 and d["weights_bytes"] is None  # the fake drafter has no model
    assert "prefill" not in vars(target) and "draft" not in vars(drafter)  # the wrappers are gone afterwards


@can_meter
def test_a_method_that_never_calls_the_drafter_has_no_drafter_entry():
    target, drafter = FakeTarget(1), FakeDrafter(1)
    found = components.measure(lambda: decode(target, None), target, drafter)
    assert found["drafter"] is None and found["target"]["calls"] == 7


def test_weights_count_tied_tensors_once():
    class Holder:
        model = torch.nn.Sequential(torch.nn.Embedding(8, 4), torch.nn.Linear(4, 8, bias=False))

    Holder.model[1].weight = Holder.model[0].weight  # tied: 32 fp32 numbers once
    assert components.module_bytes(Holder()) == 32 * 4


def test_eval_reports_memory_by_component(tmp_path):
    """A tiny eval: AR has the target only, chain both, lookup the target and its own drafter (it was metered as
    the run's drafter, never called, so it read like AR); the target's KV state after AR equals the bytes of its
    cache for the tokens it held (2 layers x keys and values x 2 KV heads x 16 dims x 4 bytes per token)."""
    from benchmarks.decoding.spec_decode import save_random_models
    from draftforge.eval.runner import EvalConfig, run_eval

    paths = save_random_models(tmp_path / "m")
    (tmp_path / "p.jsonl").write_text(json.dumps({"input_ids": list(range(2, 14))}) + "\n")
    common = dict(target=paths["target"], drafter=paths["mamba_drafter"], bench=str(tmp_path / "p.jsonl"),
                  methods=("ar", "chain", "lookup"), max_new_tokens=8, repeats=1, warmup=0, cost_repeats=0,
                  ignore_eos=True, plots=False, quiet=True, dtype="float32")
    report = run_eval(EvalConfig(**common, out_dir=str(tmp_path / "on")))
    found = report["component_memory"]["by_method"]
    (ar,), (chain,) = found["ar"].values(), found["chain"].values()  # one length bucket
    assert ar["drafter"] is None and chain["drafter"]["calls"] > 0
    (lookup,) = found["lookup"].values()  # its own prompt-lookup drafter is metered, not the run's Mamba drafter
    assert lookup["drafter"]["calls"] > 0 and lookup["drafter"]["weights_bytes"] is None
    assert ar["prompt_tokens"] == 12
    per_token = 2 * 2 * 2 * 16 * 4
    assert ar["target"]["state_bytes"] == (12 + 8 - 1) * per_token  # the last token emitted is never fed
    text = (tmp_path / "on" / "report.md").read_text()
    assert "## Memory by component" in text and "| chain | 12 |" in text
    off = run_eval(EvalConfig(**common, out_dir=str(tmp_path / "off"), component_memory=False))
    assert off["component_memory"] is None
