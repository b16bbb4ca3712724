"""The C++ CPU kernels (the ``*.cpp`` files of the op folders), compiled for the CPU at hand on first use.

They register their ops under ``torch.ops.layerzoo_cpu`` and are built together as one library,
once per (sources, torch, CPU, flags), with ``-O3 -march=native`` through
``torch.utils.cpp_extension`` into torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``); later processes load the cached library in milliseconds. Building
needs a C++ compiler and ninja; where either is missing, or the build fails, `available` says False
(logged once, with the reason) and callers keep their torch path. ``LAYERZOO_CPP_KERNELS=0`` turns
them off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

from layerzoo.errors import KernelUnsupported

log = logging.getLogger(__name__)

ENV = "LAYERZOO_CPP_KERNELS"
_HERE = Path(__file__).parent
SOURCES = [_HERE / "cpu_gemv" / "packed_fp32.cpp", _HERE / "cpu_gemv" / "packed_bf16.cpp",
           _HERE / "paged_attention" / "decode_cpu.cpp",
           _HERE / "rms_norm" / "rms_norm_cpu.cpp", _HERE / "rotary" / "rotary_cpu.cpp", _HERE / "silu_and_mul" / "silu_and_mul_cpu.cpp",
           _HERE / "qk_norm_rotary" / "qk_norm_rotary_cpu.cpp", _HERE / "argmax" / "argmax_cpu.cpp",
           _HERE / "kv_cache_write" / "kv_cache_write_cpu.cpp", _HERE / "decode_layer" / "decode_layer_cpu.cpp",
           _HERE / "gguf_matmul" / "gguf_cpu.cpp", _HERE / "int4_matmul" / "int4_cpu.cpp", _HERE / "fp8_matmul" / "fp8_cpu.cpp",
           _HERE / "mxfp4_matmul" / "mxfp4_cpu.cpp"]

# The element types of the kernels other than the GEMVs (norms, rotary, SwiGLU, paged decode
# attention: cpu_dtype.h's float_or_bf16); their wrappers refuse any other, and the KV pool routes
# only caches of these to the decode kernel's row queries.
DTYPES = (torch.float32, torch.bfloat16)

def _cpu_vendor() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("vendor_id"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


# -ffp-contract=off: the rescale ``dot * (sx * scale) + bias`` rounds the same in every tile shape,
# so a row's result does not depend on how many rows share its call. The few-row GEMVs prefetch
# their weight stream non-temporally on AMD CPUs and into L2 elsewhere (row_groups.h says why).
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]
if _cpu_vendor() == "AuthenticAMD":
    CFLAGS.append("-DLAYERZOO_WEIGHT_PREFETCH_NTA")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "why": str


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return torch.backends.cpu.get_cpu_capability()


# The headers the sources include: part of the build's name, so that editing one rebuilds.
HEADERS = [_HERE / "cpu_vec.h", _HERE / "cpu_dtype.h", _HERE / "cpu_gemv" / "row_groups.h", _HERE / "rotary" / "rotate_half.h",
           _HERE / "rms_norm" / "norm_row.h"]


def _build_name() -> str:
    digest = hashlib.sha256()
    for part in (*(src.read_bytes() for src in (*SOURCES, *HEADERS)), torch.__version__.encode(), _cpu_flags().encode(),
                 " ".join(CFLAGS).encode()):
        digest.update(part)
    return f"layerzoo_cpu_{digest.hexdigest()[:12]}"


def _build() -> tuple[bool, str]:
    if os.environ.get(ENV, "1") == "0":
        return False, f"{ENV}=0"
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return False, "this CPU has no AVX2: the scalar build would be slower than torch"
    if shutil.which("ninja") is None:
        try:  # the PyPI package (a dependency) keeps its binary beside the module, off PATH
            import ninja
        except ImportError:
            return False, "no ninja on PATH (pip install ninja)"
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    from torch.utils import cpp_extension

    missing = [src.name for src in (*SOURCES, *HEADERS) if not src.is_file()]
    if missing:  # an install that left a source out: torch's ops, the same every call
        return False, f"sources missing from {_HERE}: {', '.join(missing)}"
    try:
        cpp_extension.load(
            name=_build_name(),
            sources=[str(src) for src in SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # a missing compiler, headers, ... : the library path stays
        return False, f"building the C++ kernels failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
    return True, ""


def _register_fakes() -> None:
    """The ops' output shapes, so that a ``torch.compile``'d decode step calls them as extern
    kernels (`layerzoo.runtime.decode_capture`) instead of tracing into them."""
    fake = torch.library.register_fake
    for op in ("packed_fp32_gemv", "packed_bf16_gemv"):
        fake(f"layerzoo_cpu::{op}")(lambda x, w_ptr, n, k, bias, w_bytes, *block: x.new_empty(x.shape[0], n))
    fake("layerzoo_cpu::rms_norm")(lambda x, w, eps: torch.empty_like(x))
    fake("layerzoo_cpu::add_rms_norm")(lambda x, residual, w, eps: (torch.empty_like(x), torch.empty_like(x)))
    fake("layerzoo_cpu::rotary_embedding")(lambda x, cos, sin: x.new_empty(x.shape))
    fake("layerzoo_cpu::silu_and_mul")(lambda gate, up: gate.new_empty(gate.shape))
    fake("layerzoo_cpu::qk_norm_rotary")(lambda q, k, qw, kw, eps, cos, sin: (q.new_empty(q.shape), k.new_empty(k.shape)))
    fake("layerzoo_cpu::kv_cache_write")(lambda k, v, k_cache, v_cache, slots: None)
    fake("layerzoo_cpu::argmax_finite")(lambda logits: logits.new_empty(logits.shape[0], dtype=torch.long))
    fake("layerzoo_cpu::paged_decode_attention")(lambda q, k, v, tables, lens, scale: q.new_empty(q.shape))
    fake("layerzoo_cpu::gguf_dequantize")(lambda blocks, qtype, k, rows: blocks.new_empty(
        blocks.shape[0] if rows is None else rows.shape[0], k, dtype=torch.float32))
    fake("layerzoo_cpu::gguf_gemv")(lambda x, blocks, qtype, k, bias: x.new_empty(x.shape[0], blocks.shape[0]))
    fake("layerzoo_cpu::int4_gemv")(lambda x, q, scale, zs, group, bias: x.new_empty(x.shape[0], q.shape[0]))
    fake("layerzoo_cpu::int4_dequantize")(lambda q, scale, zs, group, out: None)
    fake("layerzoo_cpu::fp8_gemv")(lambda x, w, scale, group, bias: x.new_empty(x.shape[0], w.shape[0]))
    fake("layerzoo_cpu::fp8_dequantize")(lambda w, scale, group, out: None)


def available() -> bool:
    """Whether the C++ kernels are built and loaded (builds them on the first call)."""
    if "ok" in _state:  # no lock once decided: a compiled step traces this (dynamo refuses locks)
        return bool(_state["ok"])
    with _lock:
        if "ok" not in _state:
            ok, why = _build()
            if ok:
                _register_fakes()
            _state.update(ok=ok, why=why)
            if not ok:
                log.info("the C++ CPU kernels are off (%s); their ops run in torch", why)
        return bool(_state["ok"])


def why_unavailable() -> str:
    available()
    return str(_state.get("why", ""))


def require() -> None:
    """For a ``cpp`` backend's first line: raises `KernelUnsupported` (the op then runs in torch)
    where the kernels are not built."""
    if not available():
        raise KernelUnsupported(f"C++ kernels not built: {why_unavailable()}")
