"""The C++ CPU kernels (the ``*.cpp`` files of the op folders), compiled for the CPU at hand on first use.

They register their ops under ``torch.ops.layerzoo_cpu`` and are built together as one library,
with ``-O3 -march=native`` through ``torch.utils.cpp_extension``. The library is cached under
`cache_dir` (``$LAYERZOO_KERNEL_CACHE``, else ``$XDG_CACHE_HOME/layerzoo/cpp-kernels``, else
``~/.cache/layerzoo/cpp-kernels``) by a hash of what the build reads (sources, headers, torch, the
CPU's flags, compiler flags), never by where the sources sit: the sources are copied into the cache
before compiling, so two checkouts or virtual environments of the same code share one build instead
of rebuilding each other's (ninja rebuilds whenever a source path in its command changes). A
cached library loads in milliseconds without ninja or a compiler; the first build prints one line
on stderr, since it takes a minute. Building needs a C++ compiler and ninja; where either is
missing, or the build fails, `available` says False (logged once, with the reason and, for a
missing compiler, the package to install) and callers keep their torch path. `status` says which
happened, for ``layerzoo plugins --kernels``. ``LAYERZOO_CPP_KERNELS=0`` turns them off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import threading
import time
from pathlib import Path

import torch

from layerzoo import settings
from layerzoo.errors import KernelUnsupported

log = logging.getLogger(__name__)

ENV = "LAYERZOO_CPP_KERNELS"
CACHE_ENV = "LAYERZOO_KERNEL_CACHE"
_HERE = Path(__file__).parent
SOURCES = [_HERE / "cpu_gemv" / "packed_fp32.cpp", _HERE / "cpu_gemv" / "packed_bf16.cpp",
           _HERE / "paged_attention" / "decode_cpu.cpp",
           _HERE / "rms_norm" / "rms_norm_cpu.cpp", _HERE / "rotary" / "rotary_cpu.cpp", _HERE / "silu_and_mul" / "silu_and_mul_cpu.cpp",
           _HERE / "qk_norm_rotary" / "qk_norm_rotary_cpu.cpp", _HERE / "argmax" / "argmax_cpu.cpp",
           _HERE / "kv_cache_write" / "kv_cache_write_cpu.cpp", _HERE / "decode_layer" / "decode_layer_cpu.cpp",
           _HERE / "gguf_matmul" / "gguf_cpu.cpp", _HERE / "gguf_matmul" / "gguf_gemm_cpu.cpp",
           _HERE / "int4_matmul" / "int4_cpu.cpp", _HERE / "fp8_matmul" / "fp8_cpu.cpp",
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
# LAYERZOO_CPU_MARCH (default native) builds for another CPU: the sources choose their ISA paths at
# compile time, so ``haswell`` on an AVX-512 host runs the AVX2 paths (a separate cached build).
CFLAGS = ["-O3", f"-march={settings.text('LAYERZOO_CPU_MARCH')}", "-fopenmp", "-ffp-contract=off"]
if _cpu_vendor() == "AuthenticAMD":
    CFLAGS.append("-DLAYERZOO_WEIGHT_PREFETCH_NTA")

_lock = threading.Lock()
_state: dict[str, object] = {}  # "ok": bool, "why": str, "how": built|cached|off|failed, "library": str, "seconds": float


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
           _HERE / "rms_norm" / "norm_row.h", _HERE / "gguf_matmul" / "gguf_blocks.h"]


def _build_name() -> str:
    digest = hashlib.sha256()
    for part in (*(src.read_bytes() for src in (*SOURCES, *HEADERS)), torch.__version__.encode(), _cpu_flags().encode(),
                 " ".join(CFLAGS).encode()):
        digest.update(part)
    return f"layerzoo_cpu_{digest.hexdigest()[:12]}"


def cache_dir() -> Path:
    """Where built libraries live, one folder per build name."""
    chosen = settings.path(CACHE_ENV)
    if chosen is not None:
        return chosen
    return (settings.path("XDG_CACHE_HOME") or Path.home() / ".cache") / "layerzoo" / "cpp-kernels"


def _missing_compiler() -> str:
    compiler = settings.text("CXX")
    if shutil.which(compiler) is None:
        return (f"no C++ compiler ({compiler!r} is not on PATH): install g++ (Debian/Ubuntu: apt install g++; "
                f"Fedora: dnf install gcc-c++) or set CXX")
    return ""


def _find_ninja() -> str:
    if shutil.which("ninja") is None:
        try:  # the PyPI package (a dependency) keeps its binary beside the module, off PATH
            import ninja
        except ImportError:
            return "no ninja on PATH (pip install ninja)"
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")
    return ""


class _FileLock:
    """An exclusive lock on a file, so that two processes starting at once build once."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        import fcntl

        self.handle = open(self.path, "w")
        fcntl.flock(self.handle, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()  # closing releases the lock


def _stage_sources(into: Path) -> list[Path]:
    """Copy the sources and headers into ``into``, keeping their layout (the ``#include "../x.h"``
    paths), and return the copied sources: the build then names the same paths from any checkout."""
    for path in (*SOURCES, *HEADERS):
        target = into / path.relative_to(_HERE)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(path, target)
    return [into / src.relative_to(_HERE) for src in SOURCES]


_loaded: set[str] = set()  # build names whose library this process has loaded


def _load(library: Path) -> None:
    # A second dlopen of another copy would register the ops again, which aborts the process.
    if library.stem not in _loaded:
        torch.ops.load_library(str(library))
        _loaded.add(library.stem)
    _state.update(library=str(library))


def _compile(name: str, where: Path, library: Path) -> None:
    from torch.utils import cpp_extension

    sources = _stage_sources(where / "src")
    print(f"layerzoo: compiling the C++ CPU kernels for this CPU, once (about a minute); cached in {where}",
          file=sys.stderr, flush=True)
    start = time.perf_counter()
    build = where / "build"
    build.mkdir(exist_ok=True)
    cpp_extension.load(name=name, sources=[str(src) for src in sources], extra_cflags=CFLAGS, extra_ldflags=["-fopenmp"],
                       build_directory=str(build), is_python_module=False, verbose=False)
    # Published by a rename, so that a library at `library` is always a complete one.
    partial = where / f".{name}.so.partial"
    shutil.copyfile(build / f"{name}.so", partial)
    os.replace(partial, library)
    _loaded.add(name)  # cpp_extension.load has loaded the build folder's copy
    _state.update(library=str(library), seconds=round(time.perf_counter() - start, 1))


def _first_error(text: str) -> str:
    """The compiler's first ``error:`` line, else the last line (ninja's own ends in "subcommand failed")."""
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return next((line for line in lines if "error:" in line), lines[-1] if lines else "")


def _build() -> tuple[bool, str]:
    """Load the cached library, or build it; ``(ok, why not)``. Sets ``_state["how"]``."""
    _state["how"] = "off"
    if not settings.flag(ENV):
        return False, f"{ENV}=0"
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        return False, "this CPU has no AVX2: the scalar build would be slower than torch"
    missing = [src.name for src in (*SOURCES, *HEADERS) if not src.is_file()]
    if missing:  # an install that left a source out: torch's ops, the same every call
        return False, f"sources missing from {_HERE}: {', '.join(missing)}"
    name = _build_name()
    where = cache_dir() / name
    library = where / f"{name}.so"
    _state["how"] = "failed"
    try:
        if library.is_file():
            _load(library)
            _state["how"] = "cached"
            return True, ""
        why = _missing_compiler() or _find_ninja()
        if why:
            return False, why
        where.mkdir(parents=True, exist_ok=True)
        with _FileLock(where / ".lock"):
            if library.is_file():  # another process built it while this one waited
                _load(library)
                _state["how"] = "cached"
                return True, ""
            _compile(name, where, library)
    except Exception as exc:  # a compile error, missing headers, an unwritable cache: the torch path stays
        return False, f"building the C++ kernels failed: {_first_error(str(exc)) or repr(exc)}"
    _state["how"] = "built"
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
    fake("layerzoo_cpu::gguf_gemm")(lambda x, blocks, qtype, k, bias: x.new_empty(x.shape[0], blocks.shape[0]))
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
                # A missing compiler is the user's to fix (it costs every decode): say so where they look.
                level = logging.WARNING if why.startswith("no C++ compiler") else logging.INFO
                log.log(level, "the C++ CPU kernels are off (%s); their ops run in torch", why)
        return bool(_state["ok"])


def status() -> dict:
    """What became of the library in this process (building it if nothing was tried yet):
    ``how`` is ``cached`` (loaded from `cache_dir`), ``built`` (compiled now, ``seconds``),
    ``off`` (turned off or not worth it here) or ``failed``; ``why`` says why not, ``library``
    where it is."""
    available()
    return {"available": bool(_state["ok"]), "how": _state.get("how", ""), "why": str(_state.get("why", "")),
            "library": _state.get("library", ""), "seconds": _state.get("seconds"), "cache": str(cache_dir())}


def why_unavailable() -> str:
    available()
    return str(_state.get("why", ""))


def require() -> None:
    """For a ``cpp`` backend's first line: raises `KernelUnsupported` (the op then runs in torch)
    where the kernels are not built."""
    if not available():
        raise KernelUnsupported(f"C++ kernels not built: {why_unavailable()}")
