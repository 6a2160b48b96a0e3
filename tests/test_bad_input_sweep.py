"""benchmarks/bad_input_sweep.py: its verdict logic (fast) and its quick subset end to end (slow).

The quick subset is ~35 real CLI subprocesses (a few seconds each on an idle machine, far more on a
shared one), so it cannot fit the fast suite's ~20 s; it runs under -m slow.
"""

from __future__ import annotations

import os
import string
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import bad_input_sweep as sweep
from sweep_cases import CASES, Case

PATH_KEYS = {"root", "in", "runs", "tok", "corpus", "target"}  # what sweep_fixtures.build returns


def test_every_case_formats_and_has_a_unique_name():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names)) and len(CASES) >= 40
    for case in CASES:
        used = {f for arg in case.argv for _, f, _, _ in string.Formatter().parse(arg) if f}
        assert used <= PATH_KEYS, (case.name, used - PATH_KEYS)
        assert case.argv[0] in ("train", "export", "eval", "target", "demo", "generate")


def test_snapshot_sees_added_removed_changed_and_mode_changes_but_not_the_datasets_cache(tmp_path):
    (tmp_path / "a").write_text("1")
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").write_text("2")
    (tmp_path / "home").mkdir()  # the sweep's fresh HOME exists before any case runs
    before = sweep.snapshot(tmp_path)
    assert sweep.fs_change(before, sweep.snapshot(tmp_path)) == ""
    (tmp_path / "home" / ".cache" / "huggingface" / "datasets").mkdir(parents=True)
    assert sweep.fs_change(before, sweep.snapshot(tmp_path)) == ""  # a cache, not the user's files
    (tmp_path / "a").write_text("changed")
    (tmp_path / "d" / "b").unlink()
    (tmp_path / "new").write_text("x")
    os.chmod(tmp_path / "d", 0o700)
    change = sweep.fs_change(before, sweep.snapshot(tmp_path))
    assert "+ new" in change and "- d/b" in change and "~ a, d" in change


def test_a_case_passes_only_with_exit_2_one_error_line_no_traceback_and_files_unchanged():
    case = Case("x", ("train",), want="fix it", forbid="Repo id")
    good = {"rc": 2, "n_error_lines": 1, "traceback": False, "fs": "unchanged", "error": "error: do X to fix it"}
    assert sweep.problems(case, good) == []
    assert sweep.problems(case, {**good, "rc": 1}) == ["exit 1 (want 2)"]
    assert sweep.problems(case, {**good, "n_error_lines": 0}) == ["0 error: lines"]
    assert sweep.problems(case, {**good, "traceback": True}) == ["traceback"]
    assert sweep.problems(case, {**good, "fs": "+ runs/x"}) == ["files changed"]
    assert sweep.problems(case, {**good, "error": "error: Repo id must be"}) == [
        "error line lacks 'fix it'", "error line says 'Repo id'"]
    assert sweep.ERROR_LINE.match("draftforge eval: error: the following arguments are required: --bench")


@pytest.mark.slow
def test_quick_subset_of_the_sweep_has_no_regression():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "bad_input_sweep.py"), "--quick"], cwd=BENCHMARKS,
                          capture_output=True, text=True, timeout=3600, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          check=False)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "0 regressions" in proc.stdout
