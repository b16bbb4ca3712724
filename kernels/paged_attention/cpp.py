"""The C++ CPU backend of ``paged_decode_attention`` (``decode_cpu.cpp``), and of
``paged_prefill_attention`` for short chunks (their rows attend as decode queries): reads keys and
values in place from the paged cache instead of gathering a copy per sequence. fp32 or bf16 (q and caches of one dtype); anything
else, or a build without the C++ kernels, raises `KernelUnsupported` and the torch reference runs."""

from __future__ import annotations

import torch

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels import cpp_build


def _require(q, k_cache, v_cache) -> None:
    cpp_build.require()
    if not q.dtype == k_cache.dtype == v_cache.dtype or q.dtype not in cpp_build.DTYPES:
        raise KernelUnsupported(f"C++ paged decode attention takes fp32 or bf16, one dtype (q {q.dtype}, cache {k_cache.dtype})")


def _decode(q, k_cache, v_cache, block_tables, context_lens, scale):
    return torch.ops.layerzoo_cpu.paged_decode_attention(
        q.contiguous(), k_cache, v_cache, block_tables, context_lens, float(scale)
    )


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Same contract as `reference.paged_decode_attention`: ``q [B, Hq, D]`` → ``[B, Hq, D]``."""
    _require(q, k_cache, v_cache)
    return _decode(q, k_cache, v_cache, block_tables, context_lens, scale)


# Chunks up to this many rows (speculative verifies, short continuations) run as decode rows.
SHORT_CHUNK = 16


def paged_prefill_attention(q, k_cache, v_cache, block_tables, query_start, context_lens, scale):
    """`reference.paged_prefill_attention` for short chunks: row ``i`` of a chunk of ``n`` rows sits
    at position ``L - n + i`` and sees the keys up to it, so each row is one decode query over the
    first ``L - n + i + 1`` positions of its sequence's table. Longer chunks (prompts) raise
    `KernelUnsupported`: the torch reference runs them through flash attention."""
    _require(q, k_cache, v_cache)  # before any per-row work
    counts = query_start[1:] - query_start[:-1]
    if int(counts.max()) > SHORT_CHUNK:
        raise KernelUnsupported(f"chunks of more than {SHORT_CHUNK} rows run in torch")
    seq = torch.repeat_interleave(torch.arange(counts.numel(), device=q.device), counts)  # [T]
    row = torch.arange(q.shape[0], device=q.device) - query_start[:-1][seq]
    lens = (context_lens - counts)[seq] + row + 1
    return _decode(q, k_cache, v_cache, block_tables[seq], lens, scale)
