"""Benchmarks time their methods in a rotating order (benchmarks/common.rotated_ms): checked by the order the calls
arrive in, for rotated_ms itself and for drafter_context, which timed each drafter and context in turn (all of one
before any of the next) until it set them all up first and rotated them."""

import torch

from benchmarks.common import rotated_ms
from benchmarks.micro import drafter_context


def test_rotated_ms_warms_every_method_then_rotates_each_round():
    calls = []
    fns = {name: (lambda _, n=name: calls.append(n)) for name in "abc"}
    times = rotated_ms(fns, torch.device("cpu"), repeats=4, warmup=1, calls=2)
    assert calls == list("abc") + list("aabbcc") + list("bbccaa") + list("ccaabb") + list("aabbcc")
    assert set(times) == set("abc") and all(t["min_ms"] <= t["median_ms"] <= t["max_ms"] for t in times.values())


def test_drafter_context_rotates_its_steps_and_keeps_skipped_rows():
    calls = []
    setups = [((lambda n=n: calls.append(n)), {"drafter": n, "context": 64}) for n in ("x", "y")]
    setups.append((None, {"drafter": "z", "context": 10**6, "skipped": "beyond max_position_embeddings"}))
    rows = drafter_context.timed_rows(setups, steps=1, repeats=2, device=torch.device("cpu"))
    assert calls == ["x", "y", "x", "y", "y", "x"]  # one warm-up round of `steps` calls each, then rotated rounds
    assert [sorted(r) for r in rows[:2]] == [["context", "drafter", "ms_max", "ms_min", "ms_per_token"]] * 2
    assert rows[2] == setups[2][1]
