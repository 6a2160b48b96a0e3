# Sourced by the pipelines (not run on its own): strict mode, the repository root as the working directory
# (so `python -m benchmarks.GROUP.NAME` and the relative runs/ and recipes/ paths resolve), this checkout's
# draftforge first on the path, one thread per process, `phase TEXT`: TEXT after the seconds so far, and
# `resume_flag DIR` (below).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" OMP_NUM_THREADS=1
T0=$SECONDS
phase() { echo "== [$((SECONDS - T0)) s] $*"; }
# `$(resume_flag DIR)`, unquoted, in a `draftforge train` command: --resume when a run was started in DIR (its
# recipe.yaml), said on stderr, else nothing (a new run). A run killed part-way then continues from its latest
# checkpoint instead of being replaced; a finished run is skipped before this (its export exists), and a run whose
# recipe the pipeline's settings have since changed stops with draftforge's error naming the fields.
resume_flag() { if [ -f "$1/recipe.yaml" ]; then echo "   resuming $1 from its latest checkpoint" >&2; echo --resume; fi; }
