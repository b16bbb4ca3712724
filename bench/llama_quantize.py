"""llama.cpp's own quantizer (``llama_model_quantize`` through llama-cpp-python), run in that venv.

Used by the benches that compare against llama.cpp on files it quantized itself
(`gguf_vs_llama_cpp.py`, `quality.py --requantize`) and by ``scripts/make_kquant_fixtures.py``.
"""

from __future__ import annotations

import subprocess
import tempfile
from pathlib import Path

# llama.cpp's LLAMA_FTYPE_MOSTLY_* values, by the lower-case names its tools use
FTYPES = {"q4_0": 2, "q4_1": 3, "q8_0": 7, "q5_0": 8, "q5_1": 9, "q2_k": 10, "q3_k_m": 12, "q4_k_m": 15, "q5_k_m": 17,
          "q6_k": 18}

SCRIPT = r"""
import llama_cpp, sys
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.nthread, params.allow_requantize = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
sys.exit(llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), params))
"""


def quantize(python: str, source: Path, dst: Path, kind: str, threads: int = 2, requantize: bool = False) -> Path:
    """``source`` (a GGUF) quantized to ``kind`` (a key of `FTYPES`) at ``dst``, written beside it
    first and renamed once whole. ``requantize``: the source's weights are already quantized.
    Runs from a temporary directory (the repository's ``kernels/`` would shadow packages)."""
    if kind not in FTYPES:
        raise ValueError(f"{kind!r} is not one of {', '.join(FTYPES)}")
    tmp = Path(str(dst) + ".tmp")
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run([python, "-c", SCRIPT, str(source), str(tmp), str(FTYPES[kind]), str(threads),
                               "1" if requantize else "0"], capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp's quantizer exited {done.returncode}: {done.stderr.strip()[-400:]}")
    tmp.rename(dst)
    return dst
