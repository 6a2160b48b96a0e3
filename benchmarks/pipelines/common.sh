# Sourced by the pipelines (not run on its own): strict mode, the repository root as the working directory
# (so `python -m benchmarks.GROUP.NAME` and the relative runs/ and recipes/ paths resolve), this checkout's
# draftforge first on the path, one thread per process, and `phase TEXT`: TEXT after the seconds so far.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
T0=$SECONDS
phase() { echo "== [$((SECONDS - T0)) s] $*"; }
