#!/usr/bin/env bash
# The prepared check for a lent GPU (nothing in CI runs it): the kernel tests compiled on CUDA
# (the core's and the ssm plugin's), then every Triton op timed against its torch reference. About 5 minutes on an H200.
# Then decode graphs on CUDA (about 2 minutes): the CUDA-graph unit test, and CUDA-graph decode vs
# enforce_eager in one run (same greedy tokens, step times, ratio) on the embedded model, plus the
# random Qwen3 / Qwen3.5 hybrid when transformers is there to build them or bench/.cache is carried.
# LAYERZOO_GPU_CHECK_GRAPHS=0 skips that part; DECODE_GRAPHS_ARGS adds flags to bench/decode_graphs.py.
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
if ! "$PY" -c "import layerzoo_qwen3" 2>/dev/null; then  # the decode-graphs bench runs a random Qwen3
    "$PY" -m pip install -q --no-deps --no-build-isolation -e plugins/qwen3 || exit 2
fi
"$PY" -c "import torch, triton; print('torch', torch.__version__, '| triton', triton.__version__, '| cuda', torch.cuda.is_available())"
"$PY" bench/gpu_check.py "$@"
rc=$?
if [[ "${LAYERZOO_GPU_CHECK_GRAPHS:-1}" != 0 ]]; then
    echo "== decode graphs on CUDA =="
    HF_HUB_OFFLINE=1 "$PY" -m pytest -q -p no:cacheprovider tests/test_graphs.py tests/test_decode_graphs.py -k cuda || rc=1
    # shellcheck disable=SC2086
    HF_HUB_OFFLINE=1 timeout 600 "$PY" bench/decode_graphs.py --device cuda --dtype bfloat16 --batch 1 8 \
        --big small --hybrid tiny --rounds 3 ${DECODE_GRAPHS_ARGS:-} || rc=1
fi
exit $rc
