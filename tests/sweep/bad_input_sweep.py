"""Issue 14's bad-input and kill sweep: the slow suite runs it case by case (tests/sweep/test_sweep.py), and
as a script it prints the whole table.

    python -m tests.sweep.bad_input_sweep [--quick] [--only TEXT] [--no-kills] [--seed N] [--jobs N] [--json FILE]

On a fresh temp HOME it builds tiny inputs (inputs.py: a stdlib tokenizer + corpus, tiny targets, bad
files, one reference drafter run), then runs every case of cases.CASES as a subprocess of the real CLI
(`python -m draftforge ...`) and prints, per case, the exit code, the `error:` line, whether stderr held
a traceback and whether the files under the sweep's root were left as they were (a snapshot before and
after; caches under HOME/.cache/huggingface excepted). Then the SIGKILL table (kills.py): runs killed at
random moments, before the first checkpoint and during resumes resume to bitwise-identical weights and
metrics. Exit status 1 if any case regresses. `--quick` runs only the cases that need no trained run.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests import REPO
from tests.sweep import inputs
from tests.sweep.cases import CASES, Case

ERROR_LINE = re.compile(r"^(draftforge[\w ]*: )?error: ")
CACHE = "home/.cache"  # datasets' tokenization cache goes under CACHE/huggingface: a cache, not the user's files


def snapshot(root: Path) -> dict[str, tuple]:
    """relative path -> (mode, sha256 or link target or 'dir') for everything under root except the datasets cache."""
    out = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root).as_posix()
        if rel == CACHE or rel.startswith(CACHE + "/huggingface"):
            continue
        st = path.lstat()
        if path.is_symlink():
            out[rel] = (st.st_mode, "->" + str(path.readlink()))
        elif path.is_dir():
            out[rel] = (st.st_mode, "dir")
        else:
            out[rel] = (st.st_mode, hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def fs_change(before: dict, after: dict) -> str:
    """'' when equal, else a short list of what appeared, went or changed."""
    added = sorted(set(after) - set(before))
    gone = sorted(set(before) - set(after))
    changed = sorted(k for k in set(before) & set(after) if before[k] != after[k])
    parts = [f"{tag} {', '.join(names[:3])}{' ...' if len(names) > 3 else ''}"
             for tag, names in (("+", added), ("-", gone), ("~", changed)) if names]
    return "; ".join(parts)


def case_root(root: Path, index: int, paths: dict) -> tuple[Path, dict]:
    """A private copy of the fixtures for one case, paths inside its YAML/JSON re-rooted (checkpoints, whose
    manifests hash their files, are copied as they are), so that cases can run side by side."""
    dst = root.parent / f"{root.name}-cases" / f"{index:02d}"
    for sub in ("in", "runs", "cwd"):
        if (root / sub).exists():
            shutil.copytree(root / sub, dst / sub, symlinks=True)
    (dst / "home").mkdir(parents=True)
    for f in dst.rglob("*"):
        if f.suffix in (".yaml", ".json") and f.is_file() and "checkpoints" not in f.parts:
            text = f.read_text()
            if str(root) in text:
                f.write_text(text.replace(str(root), str(dst)))
    return dst, {k: v.replace(str(root), str(dst)) for k, v in paths.items()}


def run_case(case: Case, index: int, root: Path, paths: dict, timeout: float) -> dict:
    root, paths = case_root(root, index, paths)
    argv = case.command(paths)
    before = snapshot(root)
    t0 = time.monotonic()
    try:
        if case.interrupt:
            proc = inputs.cli_interrupted(argv, root, REPO, after=case.interrupt, timeout=timeout)
        else:
            proc = inputs.cli(argv, root, REPO, timeout=timeout)
        rc, err = proc.returncode, proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, err = "timeout", str(e)
    seconds = time.monotonic() - t0
    errors = [ln for ln in err.splitlines() if ERROR_LINE.match(ln)]
    if case.interrupt and not errors:  # the message of an interrupted command is its own line
        errors = [ln for ln in err.splitlines() if ln.startswith("interrupted")][-1:]
    change = fs_change(before, snapshot(root))
    row = {"case": case.name, "issue": case.issue, "command": "draftforge " + " ".join(argv), "rc": rc,
           "error": errors[0] if errors else "", "n_error_lines": len(errors),
           "traceback": "Traceback (most recent call last)" in err, "fs": change or "unchanged",
           "seconds": round(seconds, 1), "stderr_tail": err[-1500:] if rc != case.rc else ""}
    row["problems"] = problems(case, row)
    row["command"] = row["command"].replace(str(root), "$SWEEP")
    row["error"] = row["error"].replace(str(root), "$SWEEP")
    if not row["problems"]:
        shutil.rmtree(root, ignore_errors=True)
    return row


def problems(case: Case, row: dict) -> list[str]:
    out = []
    if row["rc"] != case.rc:
        out.append(f"exit {row['rc']} (want {case.rc})")
    if case.rc == 2 and row["n_error_lines"] != 1:
        out.append(f"{row['n_error_lines']} error: lines")
    if row["traceback"]:
        out.append("traceback")
    if case.fs == "same" and row["fs"] != "unchanged":
        out.append("files changed")
    if case.want and case.want.lower() not in row["error"].lower():
        out.append(f"error line lacks {case.want!r}")
    if case.forbid and case.forbid in row["error"]:
        out.append(f"error line says {case.forbid!r}")
    if case.pattern and not re.search(case.pattern, row["error"]):
        out.append(f"error line does not match {case.pattern!r}")
    return out


def short(text: str, root: str, width: int) -> str:
    text = text.replace("$SWEEP/", "")
    return text if len(text) <= width else text[: width - 1] + "…"


def print_tables(rows: list[dict], kills: list[dict], root: str) -> None:
    print("\n| case | # | command | exit | error line | tb | files | verdict |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        verdict = "ok" if not r["problems"] else "**" + "; ".join(r["problems"]) + "**"
        cmd = short(r["command"], root, 70).replace("|", "\\|")
        err = short(r["error"], root, 110).replace("|", "\\|")
        print(f"| {r['case']} | {r['issue']} | `{cmd}` | {r['rc']} | {err} | {'yes' if r['traceback'] else 'no'} "
              f"| {short(r['fs'], root, 40)} | {verdict} |")
    if kills:
        print("\n| kill scenario | where the kills landed | final weights + metrics vs uninterrupted |\n|---|---|---|")
        for k in kills:
            print(f"| {k['case']} | {k['kills']} | {k['result']} |")


def _report(row: dict, total: int) -> dict:
    print(f"[{total}] {row['case']}: {'; '.join(row['problems']) or 'ok'} ({row['seconds']} s)", file=sys.stderr,
          flush=True)
    return row


def run(cases: list[Case], root: Path, *, kills=(), seed: int = 0, jobs: int = 1, timeout: float = 300,
        log=lambda m: print(m, file=sys.stderr)) -> tuple[list[dict], list[dict]]:
    """Build the inputs under root (the reference run only where a case or a kill scenario needs it), then run
    `cases` and the kill scenarios named in `kills`, `jobs` side by side: (case rows, kill rows)."""
    train = bool(kills) or any(not c.quick for c in cases)
    paths = inputs.build(root, REPO, log=log, train=train)
    with ThreadPoolExecutor(jobs) as pool:
        kill_rows = None
        if kills:
            from tests.sweep.kills import kill_table

            kill_rows = pool.submit(kill_table, paths, root, REPO, seed, max(1, jobs - 1), names=kills)
        rows = list(pool.map(lambda ic: _report(run_case(ic[1], ic[0], root, paths, timeout), len(cases)),
                             enumerate(cases)))
        kill_rows = kill_rows.result() if kill_rows else []
    return rows, kill_rows


def cleanup(root: Path) -> None:
    """Remove the sweep's root and the cases' and kill scenarios' roots beside it."""
    shutil.rmtree(root, ignore_errors=True)
    for extra in ("cases", "kills"):
        shutil.rmtree(root.parent / f"{root.name}-{extra}", ignore_errors=True)


def main(argv=None) -> int:
    from tests.sweep.kills import SCENARIOS

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="only the cases that need no trained run; no kills")
    ap.add_argument("--only", help="only cases whose name contains TEXT (a comma list: any of them)")
    ap.add_argument("--no-kills", action="store_true", help="skip the SIGKILL scenarios")
    ap.add_argument("--kills-only", action="store_true", help="only the SIGKILL scenarios")
    ap.add_argument("--seed", type=int, default=0, help="seed of the random kill moments (default 0)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per case before it counts as hung")
    ap.add_argument("--jobs", type=int, default=1, help="cases run side by side, each on its own copy (default 1)")
    ap.add_argument("--json", help="also write every row as JSON here")
    ap.add_argument("--keep", help="build everything in this (new) directory and keep it")
    args = ap.parse_args(argv)
    root = Path(args.keep or tempfile.mkdtemp(prefix="df-sweep-")).resolve()
    t0 = time.monotonic()
    only = args.only.split(",") if args.only else []
    cases = [c for c in CASES if (c.quick or not args.quick) and (not only or any(t in c.name for t in only))
             and not args.kills_only]
    kills = () if args.no_kills or args.only or args.quick else SCENARIOS
    try:
        rows, kill_rows = run(cases, root, kills=kills, seed=args.seed, jobs=args.jobs, timeout=args.timeout)
        print_tables(rows, kill_rows, str(root))
    finally:
        if not args.keep:
            cleanup(root)
    bad = [r for r in rows if r["problems"]] + [k for k in kill_rows if k["result"] != "identical"]
    print(f"\n{len(rows)} cases, {len(kill_rows)} kill scenarios, {len(bad)} regressions; "
          f"{(time.monotonic() - t0) / 60:.1f} min (seed {args.seed})")
    if args.json:
        Path(args.json).write_text(json.dumps({"cases": rows, "kills": kill_rows}, indent=2, default=str))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
