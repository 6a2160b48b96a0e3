"""A wheel (what a non-editable install, a container image or a cluster gets) holds every module of draftforge/:
pyproject listed packages by hand and left out harvest and decode's drafters, methods and targets, which editable
installs (the README's) hid."""

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def test_the_wheel_holds_every_module(tmp_path):
    pytest.importorskip("setuptools", reason="building a wheel without build isolation needs setuptools")
    src = tmp_path / "src"
    shutil.copytree(REPO / "draftforge", src / "draftforge", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", ".", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path / "dist")], cwd=src, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("draftforge-*.whl")
    in_wheel = {n for n in zipfile.ZipFile(wheel).namelist() if n.endswith(".py")}
    in_repo = {p.relative_to(src).as_posix() for p in (src / "draftforge").rglob("*.py")}
    assert in_repo - in_wheel == set()
