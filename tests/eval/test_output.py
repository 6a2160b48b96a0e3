"""`draftforge eval --out`: refused before any model loads when it cannot take the report or holds a report
draftforge did not write; and a measurement that finished is never lost to an output error."""

from __future__ import annotations

import json

import pytest

from draftforge.errors import DataError
from draftforge.eval import report as report_mod
from draftforge.eval import runner
from draftforge.eval.runner import run_eval
from tests.eval.test_runner import FakeAPI, bench, cfg_for  # noqa: F401  (bench is a fixture)


@pytest.mark.parametrize("setup, message", [
    (lambda out: out.write_text("mine"), "is a file, not a directory"),
    (lambda out: (out.mkdir(), (out / "report.json").write_text('{"my": "data"}')), "not written by draftforge"),
    (lambda out: (out.mkdir(), (out / "report.md").write_text("# my notes")), "report.md that draftforge"),
    (lambda out: (out.mkdir(), (out / "speedup.png").write_text("my own plot")), "speedup.png that draftforge"),
    (lambda out: (out.mkdir(), (out / "report.json").mkdir()), "report.json that draftforge"),  # failed after the run
])
def test_an_out_that_cannot_take_the_report_is_refused_before_any_model_loads(bench, tmp_path, monkeypatch,
                                                                              setup, message):
    api = FakeAPI()
    monkeypatch.setattr(runner, "decode_api", api)
    out = tmp_path / "out"
    setup(out)
    def there():
        return {p.name: p.read_bytes() if p.is_file() else "dir" for p in ([out] if out.is_file() else out.iterdir())}

    before = there()
    with pytest.raises(DataError, match=message):
        run_eval(cfg_for(bench, tmp_path, plots=False))
    assert api.loaded == []  # nothing was loaded, let alone measured
    assert there() == before


def test_a_previous_draftforge_report_is_replaced(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "decode_api", FakeAPI())
    first = run_eval(cfg_for(bench, tmp_path, plots=True))
    out = tmp_path / "out"
    assert (out / "speedup.png").is_file()
    second = run_eval(cfg_for(bench, tmp_path, plots=False))
    assert first["files"]["json"] == second["files"]["json"]
    # the first report's plots are not left beside the second, which drew none
    assert not [p.name for p in out.iterdir() if p.suffix == ".png"]


def test_a_finished_measurement_survives_an_output_error(bench, tmp_path, monkeypatch):
    monkeypatch.setattr(runner, "decode_api", FakeAPI())

    def disk_full(report, out_dir, plots=True):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(report_mod, "write_reports", disk_full)
    with pytest.raises(DataError, match=r"No space left on device\); the measurement is saved in (\S+\.json)") as e:
        run_eval(cfg_for(bench, tmp_path, plots=False))
    rescued = json.loads(open(e.value.args[0].rsplit(" ", 1)[-1]).read())
    assert {r["method"] for r in rescued["results"]} >= {"ar", "chain"} and rescued["records"]
