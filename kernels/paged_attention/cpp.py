"""The C++ CPU backend of ``paged_decode_attention`` (``decode_cpu.cpp``): reads keys and values in
place from the paged cache instead of gathering a copy per sequence. fp32 only; anything else,
or a build without the C++ kernels, raises `KernelUnsupported` and the torch reference runs."""

from __future__ import annotations

import torch

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels import cpp_build


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Same contract as `reference.paged_decode_attention`: ``q [B, Hq, D]`` → ``[B, Hq, D]``."""
    if not cpp_build.available():
        raise KernelUnsupported(f"C++ kernels not built: {cpp_build.why_unavailable()}")
    if q.dtype != torch.float32 or k_cache.dtype != torch.float32 or v_cache.dtype != torch.float32:
        raise KernelUnsupported(f"C++ paged decode attention is fp32 only (q {q.dtype}, cache {k_cache.dtype})")
    return torch.ops.layerzoo_cpu.paged_decode_attention(
        q.contiguous(), k_cache, v_cache, block_tables, context_lens, float(scale)
    )
