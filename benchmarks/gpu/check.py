"""One command that proves draftforge's GPU path on a lent GPU machine, and writes one JSON and one Markdown table.

    python -m benchmarks.gpu.check                   # on the GPU machine (install the wheels first: README.md)
    python -m benchmarks.gpu.check --dry-run         # on any CPU: every step at toy size (tests the plumbing)
    python -m benchmarks.gpu.check --only tree_scan,cuda_graph --out runs/gpu-check-kernels

Steps, each timed and recorded as ok, failed (with the error) or skipped (with the reason); a failing step
never stops the next:
  1. cuda_tests   every CUDA-only test (the tests that skip on CPU) under pytest, in a subprocess; its counts
  2. tree_scan    STree's Triton tree-scan kernel vs its PyTorch reference vs unrolled per-path scans
  3. cuda_graph   the Mamba2 drafter's decode step and one draft(), CUDA graph vs eager
  4. train_mfu    bf16 training tokens/s of the Mamba2 drafter recipe, and MFU on a GPU of known peak
  5. eval         `draftforge eval`'s runner: AR / chain / tree tokens/s, speedup, τ and the T=0 self-check
  6. feature_eval the drafters that read the target (EAGLE-3 head, feature Mamba2): chain / tree / EAGLE-2,
                  the T=0 self-check

Timings: warm-up first, medians over repeats, methods in rotating order; nothing is asserted on a time. Writes
OUT/check.json and OUT/check.md (OUT: --out, default runs/gpu-check), each step's output in OUT/logs/, the
eval's report in OUT/eval/. Steps starting after --budget-s are skipped, so the whole run fits a lent machine's
few minutes. --dry-run runs on CPU at toy sizes: the kernel under TRITON_INTERPRET=1 (set here when triton is
installed), the CUDA-graph step skipped. Exit status: 0 when no step failed, 1 when one did, 2 for a bad --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.gpu.record import Context, Step, run_steps, tally

REPO = Path(__file__).resolve().parents[2]
STEPS = (
    Step("cuda_tests", "CUDA-only tests (pytest)", "benchmarks.gpu.cuda_only:run_step"),
    Step("tree_scan", "Triton tree scan vs PyTorch reference vs unrolled paths",
         "benchmarks.gpu.kernel_steps:tree_scan_step"),
    Step("cuda_graph", "Mamba2 drafter step: CUDA graph vs eager", "benchmarks.gpu.kernel_steps:cuda_graph_step"),
    Step("train_mfu", "bf16 training tokens/s and MFU, Mamba2 drafter recipe", "benchmarks.gpu.model_steps:train_step"),
    Step("eval", "AR / chain / tree eval: tokens/s and self-check", "benchmarks.gpu.model_steps:eval_step"),
    Step("feature_eval", "EAGLE-3 head and feature Mamba2 drafter: chain / tree / EAGLE-2 self-check",
         "benchmarks.gpu.model_steps:feature_eval_step"),
)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.gpu.check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/gpu-check", help="directory for check.json, check.md, logs/ and eval/ "
                   "(created if missing; an existing file is refused; nothing in it is deleted)")
    p.add_argument("--dry-run", action="store_true", help="run every step on CPU at toy size (the plumbing)")
    p.add_argument("--only", help="comma-separated step names to run (the others are recorded as skipped): "
                   + ", ".join(s.name for s in STEPS))
    p.add_argument("--budget-s", type=float, default=420.0,
                   help="skip the steps that would start after this many seconds (default 420)")
    p.add_argument("--pytest-timeout-s", type=float, default=240.0, help="stop the CUDA-only tests after this long")
    p.add_argument("--tests", nargs="+", default=[], help="pytest files for step 1 instead of the discovered ones")
    p.add_argument("--threads", type=int, help="torch threads (default 1, or OMP_NUM_THREADS)")
    args = p.parse_args(argv)
    for flag, value in (("--budget-s", args.budget_s), ("--pytest-timeout-s", args.pytest_timeout_s)):
        if not value > 0:  # a negative budget skipped every step and still passed
            p.error(f"{flag} must be > 0, got {value}")
    names = {s.name for s in STEPS}
    if args.only and not set(args.only.split(",")) <= names:
        p.error(f"--only: unknown step(s) {', '.join(sorted(set(args.only.split(',')) - names))}")
    return args


def refuse_out(out: Path) -> str | None:
    """The one error line for an --out that cannot be the output directory, else None."""
    if out.exists() and not out.is_dir():
        return f"error: --out {out} is an existing file, not a directory; name a directory (created if missing)"
    try:  # check.md and logs/ are replaced on a rerun: only where this check wrote them before
        ours = json.loads((out / "check.json").read_text()).get("schema", "").startswith("draftforge.gpu-check/")
    except (OSError, ValueError, AttributeError):
        ours = False
    theirs = [name for name in ("check.json", "check.md", "logs") if (out / name).exists() and not ours]
    if theirs:
        return (f"error: --out {out} holds {', '.join(theirs)}, which no earlier GPU check wrote (a rerun replaces "
                "them); name another directory")
    return None


def prepare_process(dry_run: bool) -> None:
    """Offline; and for a dry run the Triton interpreter, which must be set before triton is imported."""
    import importlib.util

    for var, value in (("HF_HUB_OFFLINE", "1"), ("HF_DATASETS_OFFLINE", "1"), ("TOKENIZERS_PARALLELISM", "false")):
        os.environ.setdefault(var, value)
    if dry_run and importlib.util.find_spec("triton") is not None and "triton" not in sys.modules:
        os.environ.setdefault("TRITON_INTERPRET", "1")


def machine(args) -> tuple[str, dict]:
    """(device, environment facts): torch's threads chosen as the CLI chooses them, the sentence recorded."""
    try:
        import torch

        from benchmarks.gpu.env import environment
        from draftforge.runtime import choose_threads

        threads = choose_threads(args.threads)
        device = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
        return device, {**environment(device), "threads": threads}
    except Exception as exc:  # noqa: BLE001 - the steps will fail on their own and say why
        return "cpu", {"error": f"{type(exc).__name__}: {exc}", "warnings": []}


def commit() -> str | None:
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() + (" (dirty)" if dirty.stdout.strip() else "") if done.returncode == 0 else None


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def no_cuda_records() -> list[dict]:
    reason = "no CUDA device (torch.cuda.is_available() is False); --dry-run runs the CPU plumbing"
    return [{"name": s.name, "title": s.title, "status": "skipped", "seconds": 0.0, "reason": reason} for s in STEPS]


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    out = Path(args.out)
    refused = refuse_out(out)
    if refused:
        print(refused, file=sys.stderr)
        return 2
    prepare_process(args.dry_run)
    out.mkdir(parents=True, exist_ok=True)
    console = sys.stdout

    def say(line: str) -> None:
        print(f"[gpu-check] {line}", file=console, flush=True)

    started, t0 = datetime.now(timezone.utc).isoformat(timespec="seconds"), time.perf_counter()
    device, env = machine(args)
    say(f"{env.get('device_name', device)}, {env.get('threads', 'threads unknown')}; output in {out}"
        + (" (dry run: CPU, toy sizes)" if args.dry_run else ""))
    for warning in env.get("warnings", []):
        say(f"warning: {warning}")
    if device != "cuda" and not args.dry_run:
        records = no_cuda_records()
    else:
        with tempfile.TemporaryDirectory(prefix="gpu-check-") as work:
            ctx = Context(root=REPO, out=out, work=Path(work), device=device, dry_run=args.dry_run, say=say,
                          tests=args.tests, pytest_timeout_s=args.pytest_timeout_s)
            only = set(args.only.split(",")) if args.only else None
            records = run_steps(list(STEPS), ctx, budget_s=args.budget_s, only=only, logs=out / "logs")
    check = {"schema": "draftforge.gpu-check/1", "command": shlex.join(["python", "-m", "benchmarks.gpu.check", *argv]),
             "started": started, "seconds": round(time.perf_counter() - t0, 1), "commit": commit(),
             "dry_run": args.dry_run, "device": device, "environment": env, "steps": records, "tally": tally(records)}
    from benchmarks.gpu.report import markdown

    write_atomic(out / "check.json", json.dumps(check, indent=2, default=str) + "\n")
    write_atomic(out / "check.md", markdown(check))
    t = check["tally"]
    say(f"{t['ok']} ok, {t['failed']} failed, {t['skipped']} skipped in {check['seconds']:.0f} s on "
        f"{env.get('device_name', device)} -> {out / 'check.json'}, {out / 'check.md'}")
    return 1 if t["failed"] or not t["ok"] or device != "cuda" and not args.dry_run else 0  # nothing ran: no pass


if __name__ == "__main__":
    raise SystemExit(main())
