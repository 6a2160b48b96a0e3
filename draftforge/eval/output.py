"""Where `draftforge eval` writes: --out checked before any model loads, and a finished measurement never lost to
an output error (the report is rescued to the system's temp directory and the error names the file)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path


def check_out(out_dir: str) -> None:
    """--out can take the report (a directory, writable, or creatable) and holds no report.json / report.md that
    draftforge did not write: checked before any model loads, not after the measurement."""
    from draftforge.errors import DataError
    from draftforge.fsutil import output_problem

    problem = output_problem(out_dir, "dir")
    if problem:
        raise DataError(f"--out {out_dir}: {problem}; give --out a directory for the report")
    existing = Path(out_dir).expanduser() / "report.json"
    if existing.is_file():
        try:
            ours = str(json.loads(existing.read_text()).get("schema", "")).startswith("draftforge.eval")
        except (ValueError, UnicodeDecodeError, AttributeError):
            ours = False
        if not ours:
            raise DataError(f"--out {out_dir}: its report.json was not written by draftforge eval; choose another "
                            "--out (draftforge never overwrites files it did not write)")
    else:  # no report of ours: any file a report writes is someone else's (a directory of that name included)
        from draftforge.eval.plots import PLOT_FILES

        theirs = [n for n in ("report.json", "report.md", *PLOT_FILES) if (Path(out_dir).expanduser() / n).exists()]
        if theirs:
            raise DataError(f"--out {out_dir}: it holds {', '.join(theirs)} that draftforge eval did not write (no "
                            "report.json of its own beside them); choose another --out")


def save_or_rescue(report: dict, out_dir: str, write) -> dict:
    """write(report) (the report files), and if that fails the measurement is not lost: the report goes to a
    JSON file in the system's temp directory, named in the one-line error."""
    import tempfile

    from draftforge.errors import DataError
    from draftforge.fsutil import atomic_write_text

    try:
        return write(report)
    except OSError as e:
        rescue = Path(tempfile.gettempdir()) / f"draftforge-eval-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.json"
        atomic_write_text(rescue, json.dumps(report, indent=1, default=str) + "\n")
        raise DataError(f"could not write the report into {out_dir} ({e.strerror or e}); the measurement is "
                        f"saved in {rescue}") from e
