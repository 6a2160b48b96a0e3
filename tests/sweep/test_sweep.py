"""The bad-input sweep (tests/sweep/bad_input_sweep.py): its verdict logic (fast), and under -m slow every case
of cases.CASES and every kill scenario of kills.py, one test each.

The slow tests share one sweep: the first of them builds the inputs and runs every selected case and
scenario, SWEEP_JOBS at a time (default 2), and each test then reads its own row, so a regression names
its case. The cases are real CLI subprocesses (a few seconds each on an idle machine, far more on a
shared one).
"""

from __future__ import annotations

import os
import string
import subprocess
import sys

import pytest

from tests import REPO
from tests.sweep import bad_input_sweep as sweep
from tests.sweep.cases import CASES, Case, slug
from tests.sweep.kills import MISSED, SCENARIOS, TRIES

PATH_KEYS = {"root", "in", "runs", "tok", "corpus", "target"}  # what inputs.build returns
BY_SLUG = {c.slug: c for c in CASES}


def test_every_case_formats_and_has_a_unique_name():
    names = [c.name for c in CASES]
    assert len(names) == len(set(names)) and len(CASES) >= 40
    assert len(BY_SLUG) == len(CASES)  # unique test ids too
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


# ---------------------------------------------------------------- the whole sweep (slow)

def _selected(session, name: str) -> list[str]:
    """The `name` parameters of this session's selected sweep tests (so -k runs only what it picks)."""
    return [item.callspec.params[name] for item in session.items
            if getattr(item, "callspec", None) and name in item.callspec.params
            and item.module.__name__ == __name__]


@pytest.fixture(scope="session")
def sweep_rows(request, tmp_path_factory):
    """Every selected case's row (by slug) and kill scenario's row (by name), from one run of the sweep."""
    cases = [BY_SLUG[s] for s in _selected(request.session, "slug")]
    kills = tuple(k for k in SCENARIOS if k in _selected(request.session, "scenario"))
    root = tmp_path_factory.mktemp("sweep")
    jobs = int(os.environ.get("SWEEP_JOBS", "2"))
    try:
        rows, kill_rows = sweep.run(cases, root, kills=kills, jobs=jobs)
    finally:
        sweep.cleanup(root)
    return {r["case"]: r for r in rows}, {k["case"]: k for k in kill_rows}


@pytest.mark.slow
@pytest.mark.parametrize("slug", list(BY_SLUG))
def test_case(sweep_rows, slug):
    case = BY_SLUG[slug]
    row = sweep_rows[0][case.name]
    assert not row["problems"], (f"{case.name}: {'; '.join(row['problems'])}\n  {row['command']}\n  "
                                 f"error line: {row['error']!r}\n{row['stderr_tail']}")


@pytest.mark.slow
@pytest.mark.parametrize("scenario", SCENARIOS, ids=slug)
def test_kill_resumes_to_the_same_bits(sweep_rows, scenario):
    row = sweep_rows[1][f"kill: {scenario}"]
    assert MISSED not in row["kills"], f"{row['case']}: a kill never landed in {TRIES} tries ({row['kills']})"
    assert row["result"] == "identical", f"{row['case']} ({row['kills']}): {row['result']}"


@pytest.mark.slow
def test_the_script_prints_its_table_with_no_regression():
    proc = subprocess.run([sys.executable, "-m", "tests.sweep.bad_input_sweep", "--quick", "--only",
                           "train: no recipe given"], cwd=REPO, capture_output=True, text=True, timeout=3600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "0 regressions" in proc.stdout
