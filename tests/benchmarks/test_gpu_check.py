"""benchmarks/gpu/check.py: every step is recorded as ok / failed / skipped and one failure never stops the next,
check.json and check.md are written, an --out that names a file is refused, and the dry run goes end to end
on CPU (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks.gpu import check, cuda_only, env, report
from benchmarks.gpu.record import Context, Skip, Step, StepFailed, run_steps, tally

REPO = Path(__file__).resolve().parents[2]
HERE = "tests.benchmarks.test_gpu_check"


def fine_step(ctx):
    return {"summary": "all good", "table": {"headers": ["a", "b"], "rows": [[1, "x|y"]]}}


def raising_step(ctx):
    raise RuntimeError("boom\nsecond line")


def skipping_step(ctx):
    raise Skip("needs CUDA")


def partial_step(ctx):
    raise StepFailed("pytest exited 1: 2 passed, 1 failed", {"summary": "2 passed, 1 failed"})


def exiting_step(ctx):
    raise SystemExit("a benchmark helper gave up")


STEPS = [Step("one", "first", f"{HERE}:fine_step"), Step("two", "raises", f"{HERE}:raising_step"),
         Step("three", "skips", f"{HERE}:skipping_step"), Step("four", "partial", f"{HERE}:partial_step"),
         Step("five", "exits", f"{HERE}:exiting_step"), Step("six", "missing module", "benchmarks.gpu.nope:step"),
         Step("seven", "after the failures", f"{HERE}:fine_step")]


def make_ctx(tmp_path, lines=None) -> Context:
    say = (lines.append if lines is not None else lambda line: None)
    return Context(root=REPO, out=tmp_path, work=tmp_path, device="cpu", dry_run=True, say=say)


def test_each_step_is_recorded_and_a_failure_never_stops_the_next(tmp_path):
    lines = []
    records = run_steps(STEPS, make_ctx(tmp_path, lines), logs=tmp_path / "logs")
    by_name = {r["name"]: r for r in records}
    assert [r["status"] for r in records] == ["ok", "failed", "skipped", "failed", "failed", "failed", "ok"]
    assert by_name["one"]["result"]["summary"] == "all good" and by_name["one"]["seconds"] >= 0
    assert by_name["two"]["error"] == "RuntimeError: boom" and "raise RuntimeError" in by_name["two"]["traceback"]
    assert by_name["three"]["reason"] == "needs CUDA"
    assert by_name["four"]["result"] == {"summary": "2 passed, 1 failed"}  # a failed step keeps what it measured
    assert by_name["five"]["error"] == "SystemExit: a benchmark helper gave up"
    assert by_name["six"]["error"].startswith("ModuleNotFoundError")
    assert (tmp_path / "logs" / "one.log").is_file() and by_name["one"]["log"].endswith("one.log")
    assert tally(records) == {"ok": 2, "failed": 4, "skipped": 1}
    assert "step 2/7 two: FAILED in" in " ".join(lines) and "step 3/7 three: skipped - needs CUDA" in lines


def test_only_and_budget_skip_with_a_reason(tmp_path):
    records = run_steps(STEPS[:2], make_ctx(tmp_path), only={"two"})
    assert records[0] == {"name": "one", "title": "first", "status": "skipped", "seconds": 0.0,
                          "reason": "not selected (--only)"}
    assert records[1]["status"] == "failed"
    records = run_steps(STEPS[:2], make_ctx(tmp_path), budget_s=-1.0)
    assert all(r["status"] == "skipped" and "time budget spent" in r["reason"] for r in records)


def test_main_writes_json_and_markdown_with_every_step(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(check, "STEPS", tuple(STEPS[:4]))
    monkeypatch.setattr(check, "prepare_process", lambda dry_run: None)  # no TRITON_INTERPRET in this process
    out = tmp_path / "out"
    threads = torch.get_num_threads()
    try:
        assert check.main(["--dry-run", "--out", str(out)]) == 1  # a step failed
    finally:
        torch.set_num_threads(threads)  # main pins torch's threads as the CLI does
    result = json.loads((out / "check.json").read_text())
    assert [(s["name"], s["status"]) for s in result["steps"]] == [
        ("one", "ok"), ("two", "failed"), ("three", "skipped"), ("four", "failed")]
    assert result["tally"] == {"ok": 1, "failed": 2, "skipped": 1} and result["dry_run"] is True
    assert result["environment"]["device_name"] == "cpu" and result["environment"]["torch_threads"] >= 1
    md = (out / "check.md").read_text()
    assert "| step | what | status | seconds | result |" in md
    assert "| 2. two | raises | FAILED |" in md and "RuntimeError: boom" in md
    assert "| 1 | x\\|y |" in md  # a step's own table, cells escaped
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert "1 ok, 2 failed, 1 skipped in" in last and str(out / "check.json") in last


def test_out_naming_a_file_is_refused_with_one_line(tmp_path):
    target = tmp_path / "taken.txt"
    target.write_text("keep me")
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu.check", "--dry-run", "--out", str(target)],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.strip() == f"error: --out {target} is an existing file, not a directory; name a directory " \
                                  "(created if missing)"
    assert target.read_text() == "keep me"


def test_pytest_summary_counts_and_cuda_test_discovery():
    out = "....s\n=== short test summary ===\n3 passed, 2 skipped, 40 deselected, 1 error in 4.12s\n"
    counts = cuda_only.parse_counts(out)
    assert (counts["passed"], counts["skipped"], counts["deselected"], counts["errors"], counts["failed"]) == \
        (3, 2, 40, 1, 0)
    assert cuda_only.parse_counts("collected nothing")["passed"] == 0
    files = cuda_only.cuda_test_files(REPO)
    assert {"tests/decode/test_cuda_graphs.py", "tests/kernels/test_tree_scan.py"} <= set(files)
    assert not any(f.startswith("tests/sweep/") for f in files)


def test_peak_table_and_mfu_reason():
    assert env.peak_bf16_flops("NVIDIA H100 80GB HBM3")[0] == 989e12
    assert env.peak_bf16_flops("NVIDIA H200")[0] == 989e12
    assert env.peak_bf16_flops("NVIDIA H100 PCIe")[0] == 756e12
    peak, why = env.peak_bf16_flops("NVIDIA GeForce RTX 4090")
    assert peak is None and "not in the peak table" in why
    assert env.peak_bf16_flops("cpu")[0] is None


def test_markdown_of_a_skipped_and_a_failed_step():
    result = {"dry_run": False, "started": "t", "seconds": 1.0, "command": "c", "tally": {"ok": 0, "failed": 1,
              "skipped": 1}, "environment": {"device_name": "NVIDIA H100 80GB HBM3", "torch": "2.11", "cuda": "12.8",
              "warnings": ["not installed: datasets"]},
              "steps": [{"name": "a", "title": "A", "status": "skipped", "seconds": 0.0, "reason": "needs CUDA"},
                        {"name": "b", "title": "B", "status": "failed", "seconds": 2.0, "error": "X: y"}]}
    md = report.markdown(result)
    assert "NVIDIA H100 80GB HBM3 · torch 2.11 · CUDA 12.8" in md and "- warning: not installed: datasets" in md
    assert "| 1. a | A | skipped | 0.0 | needs CUDA |" in md and "- **failed**: X: y" in md


class ReplayGraph:
    """CPU stand-in for CudaGraph: replay re-runs the captured call and writes its output in place."""

    def capture(self, fn):
        self.fn = fn
        fn()
        self.out = fn()
        return self.out

    def replay(self):
        self.out.copy_(self.fn())


def test_graph_step_plumbing_on_cpu_with_a_stand_in_graph():
    from benchmarks.gpu.kernel_steps import GRAPH, graph_vs_eager

    result = graph_vs_eager(GRAPH["dry"], "cpu", ReplayGraph)
    assert [r["batch"] for r in result["rows"]] == [1, 2, "draft()"]  # tree 2,2: depth batches 1 and 2
    assert all(r["max_diff"] < 1e-5 for r in result["rows"][:-1])  # the replayed step computes the eager one
    assert result["table"]["headers"][0] == "batch" and "draft()" in result["summary"]


@pytest.mark.slow
def test_dry_run_end_to_end_on_cpu(tmp_path):
    out = tmp_path / "check"
    done = subprocess.run([sys.executable, "-m", "benchmarks.gpu.check", "--dry-run", "--out", str(out)],
                          cwd=REPO, capture_output=True, text=True, timeout=900)
    result = json.loads((out / "check.json").read_text())
    statuses = {s["name"]: s["status"] for s in result["steps"]}
    assert list(statuses) == ["cuda_tests", "tree_scan", "cuda_graph", "train_mfu", "eval", "feature_eval"]
    assert statuses == {"cuda_tests": "ok", "tree_scan": "ok", "cuda_graph": "skipped", "train_mfu": "ok",
                        "eval": "ok", "feature_eval": "ok"}, [s.get("error") for s in result["steps"]]
    steps = {s["name"]: s for s in result["steps"]}
    assert steps["cuda_graph"]["reason"] == "needs CUDA"
    assert steps["cuda_tests"]["result"]["counts"]["passed"] == 0  # on CPU every CUDA-only test skips
    assert steps["train_mfu"]["result"]["mfu"] is None and steps["train_mfu"]["result"]["mfu_reason"]
    assert {r["method"] for r in steps["eval"]["result"]["rows"]} == {"ar", "chain", "tree"}
    feature = steps["feature_eval"]["result"]["table"]["rows"]  # drafter, method, ..., self-check vs AR
    assert {(r[0], r[1]) for r in feature} == {(d, m) for d in ("eagle3", "feature_mamba2")
                                               for m in ("chain", "tree", "eagle2")}
    # the dry run's 2 prompts, each identical to AR or parting from it only at a near-tie (a tiny random bf16
    # target has top-2 logit margins below the multi-row noise: 0.0018 against 0.0031 measured on 2026-12-03)
    checks = [r["self_check"] for r in steps["feature_eval"]["result"]["rows"]]
    assert all(c["defects"] == 0 and c["identical"] + c["near_ties"] == c["total"] == 2 for c in checks), feature
    assert all(abs(d["gap"]) < 0.02 for c in checks for d in c["divergences"]), feature  # a few bf16 ulps at most
    assert "| step | what | status | seconds | result |" in (out / "check.md").read_text()
    assert done.returncode == 0 and "5 ok, 0 failed, 1 skipped in" in done.stdout.strip().splitlines()[-1]


def test_a_check_where_nothing_ran_fails_and_a_users_files_in_out_are_kept(tmp_path, monkeypatch, capsys):
    """From an audit: --budget-s -1 skipped every step and exited 0; on a CUDA machine where every CUDA-only test
    skipped, step 1 was "ok"; a rerun replaced a user's check.md and logs/ in --out."""
    monkeypatch.setattr(check, "STEPS", (STEPS[2],))  # one step, which skips
    monkeypatch.setattr(check, "prepare_process", lambda dry_run: None)
    threads = torch.get_num_threads()
    try:
        assert check.main(["--dry-run", "--out", str(tmp_path / "out")]) == 1  # no step ok: no pass
        for flag in ("--budget-s", "--pytest-timeout-s"):
            with pytest.raises(SystemExit):
                check.main(["--dry-run", "--out", str(tmp_path / "out"), flag, "-1"])
            assert f"{flag} must be > 0, got -1.0" in capsys.readouterr().err
        user = tmp_path / "user"
        (user / "logs").mkdir(parents=True)
        (user / "check.md").write_text("my notes")
        assert check.main(["--dry-run", "--out", str(user)]) == 2
        assert "holds check.md, logs, which no earlier GPU check wrote" in capsys.readouterr().err
        assert (user / "check.md").read_text() == "my notes"
        assert check.main(["--dry-run", "--out", str(tmp_path / "out")]) == 1  # its own earlier output: rerun
    finally:
        torch.set_num_threads(threads)
    ctx = Context(root=REPO, out=tmp_path, work=tmp_path, device="cuda", dry_run=False, say=lambda line: None,
                  tests=["tests/x.py"], pytest_timeout_s=10)
    monkeypatch.setattr(cuda_only, "run_pytest", lambda *a: (0, "20 skipped in 1.0s"))
    with pytest.raises(StepFailed, match=r"no CUDA-only test ran on this CUDA machine \(0 passed, 0 failed, 20 "):
        cuda_only.run_step(ctx)
