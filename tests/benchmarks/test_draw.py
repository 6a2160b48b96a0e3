"""benchmarks/micro/draw.py: both ways are timed at every vocabulary size, every repeat kept, the JSON written."""

from __future__ import annotations

import json

from benchmarks.micro import draw


def test_draw_times_both_ways_at_every_vocab(tmp_path, capsys):
    out = tmp_path / "draw.json"
    result = draw.main(["--vocab", "16", "300", "--repeats", "2", "--calls", "3", "--out", str(out)])
    assert json.loads(out.read_text())["vocab"].keys() == {"16", "300"}
    for entry in result["vocab"].values():
        assert set(entry["median_ms"]) == {"torch.multinomial", "draw_one (inverse CDF)"}
        assert all(len(v) == 2 and min(v) > 0 for v in entry["ms_by_repeat"].values())
    assert "| 300 |" in capsys.readouterr().out
