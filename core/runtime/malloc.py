"""glibc malloc settings for the CPU forward pass: large temporaries come from, and go back to, the
process heap instead of fresh ``mmap`` pages.

A prefill step makes hundreds of activation tensors of megabytes each (``[T, hidden]``,
``[T, intermediate]``), and torch's CPU allocator hands each to ``malloc``. glibc serves a block
above its mmap threshold (128 KiB to 32 MiB, adjusted as blocks are freed) with a new ``mmap`` and
unmaps it on ``free``, and trims the heap top back to the OS; either way the next tensor of that
size starts on pages the kernel must fault in and zero again. Measured here (2-core VM, 2
threads, ``[1063, 1024]`` fp32): ``x.pow(2)`` took 10-14 ms by default and 0.4 ms with the
settings below, and such elementwise ops were about a third of a 0.6B model's prefill. (vLLM's CPU
backend asks for tcmalloc through ``LD_PRELOAD`` for the same reason.)

`tune_malloc` raises the mmap threshold to 1 GiB (so blocks come from the heap) and the trim
threshold to its maximum (so freed blocks stay for the next step's tensors of the same sizes).
The process then keeps its peak working set; steps repeat their shapes, so that is what the
next step needs anyway. Skipped when the user set ``MALLOC_MMAP_THRESHOLD_`` /
``MALLOC_TRIM_THRESHOLD_`` (glibc's own knobs win), with ``LAYERZOO_MALLOC_TUNING=0``, and off
glibc (musl, macOS, Windows).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

from layerzoo import settings

log = logging.getLogger(__name__)

ENV = "LAYERZOO_MALLOC_TUNING"
M_TRIM_THRESHOLD = -1  # mallopt parameter numbers from glibc's malloc.h
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 1 << 30
FALLBACK_MMAP_THRESHOLD = 32 << 20  # the most older glibcs accept (HEAP_MAX_SIZE / 2)
TRIM_THRESHOLD = 2**31 - 1  # mallopt takes an int

_tuned: bool | None = None


def glibc():
    """The C library when it is glibc (has ``mallopt`` and ``gnu_get_libc_version``), else None."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        return libc
    except (OSError, AttributeError):
        return None


def tune_malloc(env=None) -> bool:
    """Keep large freed blocks in the heap for reuse (see the module docstring); returns whether the
    settings are in force. Idempotent: the first call decides."""
    global _tuned
    if _tuned is not None:
        return _tuned
    if not settings.flag(ENV, env) or any(settings.is_set(k, env) for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")):
        _tuned = False
        return _tuned
    libc = glibc()
    if libc is None:
        _tuned = False
        return _tuned
    mmap_ok = libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 or libc.mallopt(M_MMAP_THRESHOLD, FALLBACK_MMAP_THRESHOLD) == 1
    trim_ok = libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    _tuned = mmap_ok and trim_ok
    if not _tuned:
        log.info("glibc mallopt refused the malloc settings (mmap %s, trim %s)", mmap_ok, trim_ok)
    return _tuned


def trim() -> bool:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``): after loading, the
    copies a checkpoint passed through are free but, with the settings above, stay resident.
    Returns whether anything was released (False off glibc)."""
    libc = glibc()
    return bool(libc is not None and libc.malloc_trim(0))
