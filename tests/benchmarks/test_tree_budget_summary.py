"""benchmarks/decoding/tree_budget.py's summary by hand: speedup in tokens per second, not seconds, since a bf16
near-tie can move an EOS and change how many tokens a method's answers hold."""

import pytest

from benchmarks.decoding import tree_budget
from draftforge.decode.base import DecodeStats


def test_speedup_is_a_ratio_of_median_tokens_per_second():
    def run(tokens, secs):
        stats = [DecodeStats(new_tokens=tokens[-1], target_forwards=4, accepted_per_round=[1, 1, 1, 1],
                             drafted_per_round=[2, 2, 2, 2])]
        return {"secs": secs, "tokens": tokens, "stats": stats, "outs": [[0] * tokens[-1]]}

    points = {"ar": (None, {"method": "ar"}), "eagle2 N=10": (None, {"method": "eagle2", "N": 10})}
    # AR: 88 tokens in 1.0, 1.1 and 0.9 s; eagle2: 128 tokens (its EOS moved) in the same seconds
    runs = {"ar": run([88, 88, 88], [1.0, 1.1, 0.9]), "eagle2 N=10": run([128, 128, 128], [1.0, 1.1, 0.9])}
    rows = {r["name"]: r for r in tree_budget.summarize(points, runs)}
    assert rows["ar"]["tokens_per_s"] == pytest.approx(88 / 1.0) and rows["ar"]["speedup"] == pytest.approx(1.0)
    assert rows["eagle2 N=10"]["tokens_per_s"] == pytest.approx(128 / 1.0)
    assert rows["eagle2 N=10"]["speedup"] == pytest.approx(128 / 88)  # equal seconds, more tokens: faster
    assert rows["eagle2 N=10"]["tokens_per_repeat"] == [128, 128, 128]
