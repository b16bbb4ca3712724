#!/usr/bin/env bash
# The prepared check for a lent GPU (nothing in CI runs it): the kernel tests compiled on CUDA
# (the core's and the ssm plugin's), then every Triton op timed against its torch reference. About 5 minutes on an H200.
#
#   bench/gpu_check.sh                          # both parts
#   bench/gpu_check.sh --json "$OUT/gpu.json"   # also keep the rows as JSON
#   PYTHON=/path/to/python bench/gpu_check.sh   # an interpreter with torch + triton (default:
#                                               # .venv/bin/python if present, else python3)
# Other flags (--no-tests, --no-bench, --test-timeout S, --smoke): see bench/gpu_check.py.
set -uo pipefail
cd "$(dirname "$0")/.."

PY="${PYTHON:-}"
if [[ -z "$PY" ]]; then
    if [[ -x .venv/bin/python ]]; then PY=.venv/bin/python; else PY=python3; fi
fi
if ! "$PY" -c "import layerzoo" 2>/dev/null; then
    echo "layerzoo not importable by $PY: installing it editable (no dependencies)"
    "$PY" -m pip install -q --no-deps --no-build-isolation -e . || exit 2
fi
if ! "$PY" -c "import layerzoo_ssm" 2>/dev/null; then  # its kernels are tested and timed too
    "$PY" -m pip install -q --no-deps --no-build-isolation -e plugins/ssm || exit 2
fi
"$PY" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.cuda.is_available())"
exec "$PY" bench/gpu_check.py "$@"
