"""SIGKILL tests of the sweep: training runs killed at random moments resume to the same bits.

The reference is the uninterrupted run `runs/good` (inputs.py). Each scenario trains the same
recipe into its own output_dir, SIGKILLs the CLI process at chosen moments, then `--resume`s until
the run completes; the final export's model.safetensors and metrics.jsonl must equal the
reference's byte for byte. Moments are drawn uniformly over 1.25 x the reference's time from its
first to its last logged step, counted from when the killed process starts training (a kill during
imports or data loading leaves nothing new on disk).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

from tests.sweep.inputs import cli_env, good_recipe

SCENARIOS = ("before the first checkpoint", "at a random moment #1", "at a random moment #2",
             "three times, twice during resumes", "at a random moment, then a torn metrics line")


def _start(argv: list[str], root: Path, repo: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "draftforge", *argv], cwd=root / "cwd", env=cli_env(root, repo),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for(cond, proc, timeout=300.0, poll=0.005) -> bool:
    """Poll until cond() (True) or the process ends (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        if proc.poll() is not None:
            return cond()
        time.sleep(poll)
    return False


def _checkpoints(run: Path) -> list[Path]:
    return sorted(p for p in (run / "checkpoints").glob("step-*") if p.is_dir())


def _logged_steps(run: Path) -> int:
    path = run / "metrics.jsonl"
    return path.read_text().count("\n") if path.exists() else 0


def run_once(argv, root, repo, kill=None) -> tuple[int | None, str]:
    """Run the CLI; `kill(proc)` returns once it is time to SIGKILL (None: let it finish). (rc, where killed)."""
    proc = _start(argv, root, repo)
    where = ""
    if kill is not None:
        where = kill(proc)
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        else:
            where = "finished before the kill"
    _, err = proc.communicate(timeout=600)
    if proc.returncode not in (0, -signal.SIGKILL):
        raise RuntimeError(f"{' '.join(argv)} exited {proc.returncode}:\n{err[-2000:]}")
    return proc.returncode, where


def _training_since(run: Path, start_ns: int) -> bool:
    """This process is training: it logged a first step (fresh run) or rewrote metrics.jsonl (resume)."""
    try:
        return (run / "metrics.jsonl").stat().st_mtime_ns >= start_ns
    except FileNotFoundError:
        return False


def _where(run: Path) -> str:
    steps = [int(p.name.split("-")[1]) for p in _checkpoints(run)]
    return f"ckpts {steps}, {_logged_steps(run)} steps logged{', exported' if (run / 'export').is_dir() else ''}"


def at_random(delay: float, run: Path):
    """A kill moment: `delay` seconds after this process began training (its startup is not drawn from)."""
    def kill(proc):
        start_ns = time.time_ns() - 10_000_000
        _wait_for(lambda: _training_since(run, start_ns), proc)
        time.sleep(delay)
        return _where(run)
    return kill


def before_first_checkpoint(run: Path, scale: float = 1.0):  # noqa: ARG001  (no moment to scale)
    def kill(proc):
        _wait_for(lambda: _logged_steps(run) >= 1, proc)
        return _where(run)
    return kill


def _same_bits(run: Path, ref: Path) -> str:
    bad = [name for name in ("export/model.safetensors", "metrics.jsonl")
           if not (run / name).is_file() or (run / name).read_bytes() != (ref / name).read_bytes()]
    return "identical" if not bad else "DIFFERS: " + ", ".join(bad)


MISSED = "ran to the end"  # a note's start when the process finished before its kill moment
TRIES, SHRINK = 4, 0.6  # a scenario whose kill missed is run again from nothing, its moments this much earlier


def scenario(name, p, root, repo, kills, torn=False) -> dict:
    """Train into runs/kill-NAME, applying each kill in turn (the first on a fresh start, later ones on
    --resume), optionally tear the last metrics line, then resume to the end and compare with the reference.
    A kill that finds the run finished tested nothing: the scenario starts over (its run directory, which
    only it writes, removed) with every moment SHRINK times earlier, up to TRIES times; the row says so."""
    run, recipe = _paths(root, name)
    recipe.write_text(yaml.safe_dump(good_recipe(p, str(run))))
    for attempt in range(TRIES):
        if attempt and run.exists():
            shutil.rmtree(run)
        notes = _apply_kills(run, recipe, root, repo, kills, SHRINK ** attempt)
        if not any(note.startswith(MISSED) for note in notes):
            break
    if attempt:
        notes.append(f"{attempt} earlier tr{'y' if attempt == 1 else 'ies'} had a kill land after the run ended")
    if torn and (run / "metrics.jsonl").exists():
        with open(run / "metrics.jsonl", "a") as f:
            f.write('{"step": 99, "loss": 1.2')  # a line cut short by the crash
        notes.append("torn last metrics line")
    run_once(["train", str(recipe), "--resume"], root, repo)
    return {"case": f"kill: {name}", "kills": "; ".join(notes), "result": _same_bits(run, Path(p["runs"]) / "good")}


def _apply_kills(run: Path, recipe: Path, root, repo, kills, scale: float) -> list[str]:
    """Each kill in turn, its moment times `scale`: a note per kill (where it landed, or MISSED ...)."""
    notes, resume = [], False
    for kill in kills:
        if resume and not (run / "recipe.yaml").exists():
            resume = False  # killed before the run claimed its directory: nothing to resume
        rc, where = run_once(["train", str(recipe)] + (["--resume"] if resume else []), root, repo,
                             kill(run, scale))
        notes.append(where if rc else f"{MISSED} ({where})")
        resume = True
    return notes


def _paths(root: Path, name: str) -> tuple[Path, Path]:
    slug = name.replace(" ", "-").replace("#", "")
    return root / "runs" / f"kill-{slug}", root / "in" / f"kill-{slug}.yaml"


def reference_span(p, root, repo) -> float:
    """1.25 x the seconds from the first to the last logged step of a clean run of the recipe: most kills land
    mid-training, about a fifth around the final checkpoint and the export (which take long on a busy CPU)."""
    run, recipe = _paths(root, "span")
    values = good_recipe(p, str(run))
    recipe.write_text(yaml.safe_dump(values))
    proc = _start(["train", str(recipe)], root, repo)
    _wait_for(lambda: _logged_steps(run) >= 1, proc)
    t0 = time.monotonic()
    _wait_for(lambda: _logged_steps(run) >= values["train"]["max_steps"], proc)
    span = time.monotonic() - t0
    proc.communicate(timeout=600)
    return max(1.25 * span, 0.5)


def kill_table(p, root, repo, seed: int, jobs: int = 1, names=SCENARIOS) -> list[dict]:
    """The scenarios named (all by default), `jobs` at a time, in their own root beside the cases' (root-kills)."""
    from concurrent.futures import ThreadPoolExecutor

    kroot = root.parent / f"{root.name}-kills"
    for sub in ("in", "runs", "cwd", "home"):
        (kroot / sub).mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    span = reference_span(p, kroot, repo)
    def rand():  # moments drawn here, in order, so a seed gives the same moments however threads interleave
        delay = rng.uniform(0, span)
        return lambda run, scale=1.0: at_random(delay * scale, run)

    plans = [(SCENARIOS[0], [before_first_checkpoint], False),
             (SCENARIOS[1], [rand()], False), (SCENARIOS[2], [rand()], False),
             (SCENARIOS[3], [rand(), rand(), rand()], False),
             (SCENARIOS[4], [rand()], True)]  # every moment drawn, so a scenario's moments do not depend on names
    plans = [plan for plan in plans if plan[0] in names]
    with ThreadPoolExecutor(jobs) as pool:
        rows = list(pool.map(lambda plan: scenario(plan[0], p, kroot, repo, plan[1], torn=plan[2]), plans))
    for r in rows:
        r["span_s"] = round(span, 1)
    return rows
