"""The GPU check's step recording: each step runs timed, and ends as ok (its result), failed (the error, a
traceback tail, any partial result) or skipped (the reason); one step's failure never stops the next.

A step is a function `fn(ctx) -> dict` named as "module:attr" and imported only when it runs, so a module
that cannot import (a missing package) fails its own step only. It raises `Skip(reason)` where it cannot run
here, `StepFailed(message, partial)` to fail with what it measured so far; any other exception fails it too.
"""

from __future__ import annotations

import contextlib
import importlib
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable


class Skip(Exception):
    """The step cannot run here; the message is the reason."""


class StepFailed(Exception):
    """The step ran and failed; `partial` is what it measured, kept in the record."""

    def __init__(self, message: str, partial: dict | None = None):
        super().__init__(message)
        self.partial = partial


@dataclass(frozen=True)
class Step:
    name: str  # a key in check.json
    title: str  # one line for the progress and the table
    target: str  # "module:attr" of fn(ctx) -> dict


@dataclass
class Context:
    """What every step reads: where things go, which device, toy or full size."""

    root: Path  # the repository root
    out: Path  # --out: check.json, check.md, logs/, eval/
    work: Path  # scratch space for models and data (a temporary folder)
    device: str  # "cuda" or "cpu"
    dry_run: bool
    say: Callable[[str], None] = print
    tests: list[str] = field(default_factory=list)  # --tests: pytest files instead of the discovered ones
    pytest_timeout_s: float = 240.0

    def size(self, table: dict) -> dict:
        """A step's sizes: table["dry"] under --dry-run, else table["full"]."""
        return table["dry" if self.dry_run else "full"]


def resolve(target: str) -> Callable:
    module, attr = target.split(":")
    return getattr(importlib.import_module(module), attr)


def error_line(exc: BaseException) -> str:
    """The first line of the error, after its type (a StepFailed's message is the step's own: no type)."""
    text = str(exc).strip().splitlines()
    first = text[0] if text else ""
    return first if isinstance(exc, StepFailed) else f"{type(exc).__name__}: {first}".rstrip(": ")


def run_step(step: Step, ctx: Context, log: Path | None = None) -> dict:
    """Run one step, its stdout/stderr into `log` (when given); the record: name, title, status, seconds and
    result / error (+ traceback) / reason."""
    record = {"name": step.name, "title": step.title, "status": "ok", "seconds": 0.0}
    start = time.perf_counter()
    try:
        with _redirected(log):
            record["result"] = resolve(step.target)(ctx)
    except Skip as exc:
        record.update(status="skipped", reason=str(exc))
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # SystemExit too: a benchmark helper that gives up fails its step only
        full = "".join(traceback.format_exception(exc))
        record.update(status="failed", error=error_line(exc), traceback="\n".join(full.splitlines()[-20:]))
        if isinstance(exc, StepFailed) and exc.partial is not None:
            record["result"] = exc.partial
        if log is not None:  # the whole traceback, after the step's own output
            with log.open("a", encoding="utf-8") as f:
                f.write("\n" + full)
    record["seconds"] = round(time.perf_counter() - start, 2)
    if log is not None:
        record["log"] = str(log)
    return record


@contextlib.contextmanager
def _redirected(log: Path | None):
    if log is None:
        yield
        return
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w", encoding="utf-8") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        yield


def run_steps(steps: list[Step], ctx: Context, *, budget_s: float | None = None,
              only: set[str] | None = None, logs: Path | None = None) -> list[dict]:
    """Every step in order, each recorded; a step not in `only`, or reached after `budget_s`, is skipped."""
    records, start = [], time.perf_counter()
    for i, step in enumerate(steps, 1):
        head = f"step {i}/{len(steps)} {step.name}"
        spent = time.perf_counter() - start
        if only is not None and step.name not in only:
            record = {"name": step.name, "title": step.title, "status": "skipped", "seconds": 0.0,
                      "reason": "not selected (--only)"}
        elif budget_s is not None and spent > budget_s:
            record = {"name": step.name, "title": step.title, "status": "skipped", "seconds": 0.0,
                      "reason": f"time budget spent ({spent:.0f} s of --budget-s {budget_s:.0f})"}
        else:
            ctx.say(f"{head}: {step.title} ...")
            record = run_step(step, ctx, None if logs is None else logs / f"{step.name}.log")
        ctx.say(f"{head}: {progress_line(record)}")
        records.append(record)
    return records


def progress_line(record: dict) -> str:
    status = record["status"]
    if status == "ok":
        return f"ok in {record['seconds']:.1f} s - {record['result'].get('summary', '')}".rstrip(" -")
    if status == "failed":
        return f"FAILED in {record['seconds']:.1f} s - {record['error']}"
    return f"skipped - {record['reason']}"


def tally(records: list[dict]) -> dict[str, int]:
    return {status: sum(r["status"] == status for r in records) for status in ("ok", "failed", "skipped")}
