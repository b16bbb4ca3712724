"""The C++ CPU backend of ``kv_cache_write`` (``kv_cache_write_cpu.cpp``): both caches' rows in one
call. Rows of the caches' dtype only (a cast, or a build without the C++ kernels, raises
`KernelUnsupported` and the torch reference runs)."""

from __future__ import annotations

import torch

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels import cpp_build


def _rows(x):
    return x if x.stride(-1) == 1 and x.stride(-2) == x.shape[-1] else x.contiguous()


def kv_cache_write(k, v, k_cache, v_cache, slots):
    """Same contract as `reference.kv_cache_write`."""
    cpp_build.require()
    if k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise KernelUnsupported(f"C++ kv_cache_write stores rows of the cache's dtype (k {k.dtype}, cache {k_cache.dtype})")
    torch.ops.layerzoo_cpu.kv_cache_write.default(_rows(k), _rows(v), k_cache, v_cache, slots)
