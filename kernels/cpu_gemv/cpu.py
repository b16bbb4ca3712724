"""The C++ backend of ``cpu_gemv`` (``gemv.cpp``), compiled for the CPU at hand on first use.

The source is built once per (source, torch, CPU) with ``-O3 -march=native`` through
``torch.utils.cpp_extension`` into torch's extension cache (``TORCH_EXTENSIONS_DIR``, by default
``~/.cache/torch_extensions``); later processes load the cached library in milliseconds. Building
needs a C++ compiler and ninja; where either is missing, or the build fails, `available` says False
(logged once, with the reason) and callers keep their library path. ``LAYERZOO_CPU_GEMV=0`` turns
the kernel off.

Shapes: ``x [M, K]`` fp32 contiguous, ``q [N, K]`` int8 / ``w [N, K]`` fp32 contiguous, ``scale [N]``,
``bias [N]`` or None → ``[M, N]`` fp32. Meant for few rows (decode); it reads every weight once per
call whatever ``M`` is, but multiplies at fp32 FMA speed, so many-row calls belong to a GEMM.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

log = logging.getLogger(__name__)

ENV = "LAYERZOO_CPU_GEMV"
SOURCE = Path(__file__).with_name("gemv.cpp")

# -ffp-contract=off: the rescale ``dot * (sx * scale) + bias`` rounds the same in every tile shape,
# so a row's result does not depend on how many rows share its call.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffp-contract=off"]

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


def _build_name() -> str:
    digest = hashlib.sha256()
    for part in (SOURCE.read_bytes(), torch.__version__.encode(), _cpu_flags().encode(), " ".join(CFLAGS).encode()):
        digest.update(part)
    return f"layerzoo_cpu_gemv_{digest.hexdigest()[:12]}"


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

    try:
        cpp_extension.load(
            name=_build_name(),
            sources=[str(SOURCE)],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=False,
        )
    except Exception as exc:  # a missing compiler, headers, ... : the library path stays
        return False, f"building {SOURCE.name} failed: {str(exc).strip().splitlines()[-1] if str(exc).strip() else exc!r}"
    return True, ""


def available() -> bool:
    """Whether the C++ kernel is built and loaded (builds it on the first call)."""
    with _lock:
        if "ok" not in _state:
            ok, why = _build()
            _state.update(ok=ok, why=why)
            if ok:
                _register_fakes()
            else:
                log.info("cpu_gemv: the C++ decode kernel is off (%s); linears use torch's library kernels", why)
        return bool(_state["ok"])


def why_unavailable() -> str:
    available()
    return str(_state.get("why", ""))


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ (q [N, K] * scale[:, None])^T + bias`` → ``[M, N]``, fp32. Call `available` first."""
    return torch.ops.layerzoo_cpu.int8_gemv(x, q, scale, bias)


def f32_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ w [N, K]^T + bias`` → ``[M, N]``, fp32. Call `available` first."""
    return torch.ops.layerzoo_cpu.f32_gemv(x, w, bias)


def _register_fakes() -> None:
    """Shapes for ``torch.compile`` (the ops are extern calls in a compiled decode step)."""

    @torch.library.register_fake("layerzoo_cpu::int8_gemv")
    def _(x, q, scale, bias):
        return x.new_empty(x.shape[0], q.shape[0])

    @torch.library.register_fake("layerzoo_cpu::f32_gemv")
    def _(x, w, bias):
        return x.new_empty(x.shape[0], w.shape[0])

