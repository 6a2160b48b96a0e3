"""Step 1 of the GPU check: every CUDA-only test, run by pytest in a subprocess; also the pytest plugin that
selects them (`-p benchmarks.gpu.cuda_only`).

A test is CUDA-only when it skips on a CPU machine for want of CUDA: it carries the `kernel` marker (Triton
kernel cases, skipped by tests/conftest.py where no kernel can run) or a `skipif` whose reason names CUDA
(tests/decode/test_cuda_graphs.py's real graphs). The files searched are those under tests/ (the sweep left
out) whose text marks such a test, so a new CUDA-only test is picked up without changing this file.

    python -m pytest -q -p benchmarks.gpu.cuda_only tests/decode/test_cuda_graphs.py tests/kernels/test_tree_scan.py
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from benchmarks.gpu.env import ensure_kernels_importable
from benchmarks.gpu.record import StepFailed

PLUGIN = "benchmarks.gpu.cuda_only"
MARKS_CUDA_ONLY = re.compile(r"pytest\.mark\.kernel|skipif\([^\n]*cuda", re.IGNORECASE)
COUNT = re.compile(r"(\d+) (passed|failed|skipped|deselected|errors?|xfailed|xpassed)\b")

ensure_kernels_importable()  # as a plugin, before the test modules import draftforge.kernels


def is_cuda_only(item) -> bool:
    """A collected test that skips without CUDA (see the module docstring)."""
    if item.get_closest_marker("kernel") is not None:
        return True
    return any(re.search("cuda", str(m.kwargs.get("reason", "")), re.IGNORECASE) for m in item.iter_markers("skipif"))


def pytest_collection_modifyitems(config, items) -> None:
    keep = [item for item in items if is_cuda_only(item)]
    dropped = [item for item in items if not is_cuda_only(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
    items[:] = keep


def cuda_test_files(root: Path) -> list[str]:
    """Test files under root/tests (tests/sweep left out) that mark a CUDA-only test, relative to root."""
    found = []
    for path in sorted((root / "tests").rglob("test_*.py")):
        rel = path.relative_to(root)
        if rel.parts[1] != "sweep" and MARKS_CUDA_ONLY.search(path.read_text(encoding="utf-8")):
            found.append(rel.as_posix())
    return found


def parse_counts(output: str) -> dict[str, int]:
    """The counts of pytest's last summary line ('3 passed, 2 skipped, 40 deselected in 4.1s'), zeros filled."""
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "deselected": 0, "xfailed": 0, "xpassed": 0}
    lines = [ln for ln in output.splitlines() if COUNT.search(ln) and re.search(r" in [\d.]+s", ln)]
    for number, what in COUNT.findall(lines[-1] if lines else ""):
        counts["errors" if what.startswith("error") else what] += int(number)
    return counts


def last_line(output: str) -> str:
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


def run_pytest(files: list[str], root: Path, log: Path, timeout_s: float) -> tuple[int | None, str]:
    """(return code or None on timeout, output) of pytest over `files` with the plugin; the output goes to log."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # on CUDA the real kernel runs
    env.setdefault("HF_HUB_OFFLINE", "1")
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", PLUGIN, "-p", "no:cacheprovider", *files]
    with log.open("w", encoding="utf-8") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        out.flush()
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # pytest and the subprocesses its tests started
            proc.wait()
            code = None
    return code, log.read_text(encoding="utf-8", errors="replace")


def run_step(ctx) -> dict:
    """Step 1: run the CUDA-only tests; failed when pytest fails or times out, the counts either way."""
    import importlib.util

    if importlib.util.find_spec("pytest") is None:
        raise StepFailed("pytest is not installed (benchmarks/gpu/wheels.sh fetches it)")
    files = ctx.tests or cuda_test_files(ctx.root)
    if not files:
        raise StepFailed("no test file under tests/ marks a CUDA-only test")
    ctx.say(f"pytest over {len(files)} file(s): {' '.join(files)}")
    code, output = run_pytest(files, ctx.root, ctx.out / "logs" / "cuda_tests.pytest.log", ctx.pytest_timeout_s)
    counts = parse_counts(output)
    summary = (f"{counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped"
               + (f", {counts['errors']} errors" if counts["errors"] else ""))
    result = {"files": files, "returncode": code, "counts": counts, "summary": summary,
              "log": str(ctx.out / "logs" / "cuda_tests.pytest.log"),
              "table": {"headers": ["files", *counts], "rows": [[", ".join(files), *counts.values()]]}}
    if ctx.device == "cuda" and counts["skipped"]:
        result["notes"] = [f"{counts['skipped']} CUDA-only test(s) skipped on a CUDA machine: read the log"]
    if code is None:
        raise StepFailed(f"pytest ran past {ctx.pytest_timeout_s:.0f} s and was stopped ({summary} by then)", result)
    if code != 0:
        said = summary if any(counts.values()) else last_line(output)
        raise StepFailed(f"pytest exited {code}: {said}", result)
    if ctx.device == "cuda" and not counts["passed"]:  # every CUDA-only test skipped on the GPU: nothing checked
        raise StepFailed(f"no CUDA-only test ran on this CUDA machine ({summary}): read the log", result)
    return result
