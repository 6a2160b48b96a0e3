"""metrics.jsonl: one JSON line per logged step, tolerant of a line torn by a crash or a full disk."""

from __future__ import annotations

import json
import os
from pathlib import Path


def read_lines(path: Path) -> list[dict]:
    """The records of a metrics file; a torn (unparseable) last line is dropped, a torn middle line is an error."""
    if not path.exists():
        return []
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    records = []
    for i, ln in enumerate(lines):
        try:
            records.append(json.loads(ln))
        except json.JSONDecodeError:
            if i == len(lines) - 1:  # a write cut short by a crash: that step is logged again on resume
                break
            from draftforge.errors import CheckpointError

            raise CheckpointError(f"{path} line {i + 1} is not JSON; the file was edited or corrupted") from None
    return records


def read_metrics(run_dir: str | os.PathLike) -> list[dict]:
    return read_lines(Path(run_dir) / "metrics.jsonl")


class MetricsLog:
    """On resume, records past the resumed step (and a torn last line) are dropped, so the log matches a clean run."""

    def __init__(self, path: Path, active: bool, truncate_after: int):
        self.path, self.active = path, active
        if active and path.exists():
            keep = [r for r in read_lines(path) if r["step"] <= truncate_after]
            path.write_text("".join(json.dumps(r) + "\n" for r in keep))

    def write(self, record: dict) -> None:
        if self.active:
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
