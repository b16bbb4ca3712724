"""Top-k / top-p filtering as a Triton kernel: one program per row, thresholds found by binary
search over the row instead of a sort.

Each logit ``x`` maps to an int key that orders like ``x`` (its fp32 bits, with the magnitude bits
of negatives flipped), so a search over keys finds a threshold exactly, in at most 32 passes:

- top-k: the k-th largest key, the largest ``K`` with ``#{key >= K} >= k``;
- top-p: among the survivors, the smallest ``K`` with ``Σ_{key > K} exp(x - max) < p · Z``, where
  ``Z`` is the survivors' total: token ``i`` stays when the mass ranked before it is below ``p``.

The kept set is ``{key >= threshold}``: on tie-free rows exactly the reference's. Where logits tie
at a cut, every tied token stays here, while the reference (a sort) keeps them by sort position;
and a token whose preceding mass is within rounding of ``p`` may fall either way.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerzoo import settings
from layerzoo.errors import KernelUnsupported

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _order_key(b_x):
    """fp32 → int64 with the same order: the bits, magnitude flipped for negatives."""
    b_bits = b_x.to(tl.int32, bitcast=True)
    return tl.where(b_bits >= 0, b_bits, b_bits ^ 0x7FFFFFFF).to(tl.int64)


@triton.jit
def top_k_top_p_kernel(logits, out, top_k, top_p, V, stride_in, stride_out, BLOCK_V: tl.constexpr):
    i_b = tl.program_id(0)
    p_in = logits + i_b * stride_in
    p_out = out + i_b * stride_out
    k = tl.load(top_k + i_b)
    p = tl.load(top_p + i_b).to(tl.float32)
    o_v = tl.arange(0, BLOCK_V)

    # pass 1: the row's largest logit and its key range
    x_max = float("-inf")
    key_min = tl.full([], 2**31, tl.int64)
    key_max = tl.full([], -(2**31) - 1, tl.int64)
    for v0 in range(0, V, BLOCK_V):
        m_v = v0 + o_v < V
        # [BLOCK_V]
        b_x = tl.load(p_in + v0 + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
        b_key = _order_key(b_x)
        x_max = tl.maximum(x_max, tl.max(b_x, axis=0))
        key_min = tl.minimum(key_min, tl.min(tl.where(m_v, b_key, 2**31), axis=0))
        key_max = tl.maximum(key_max, tl.max(tl.where(m_v, b_key, -(2**31) - 1), axis=0))

    # top-k: #{key >= lo} >= k > #{key >= hi}, narrowed to the k-th largest key
    key_k = key_min
    if (k > 0) & (k < V):
        lo, hi = key_min, key_max + 1
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            count = tl.zeros([], tl.int64)
            for v0 in range(0, V, BLOCK_V):
                m_v = v0 + o_v < V
                b_x = tl.load(p_in + v0 + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
                count += tl.sum((m_v & (_order_key(b_x) >= mid)).to(tl.int64), axis=0)
            lo = tl.where(count >= k, mid, lo)
            hi = tl.where(count >= k, hi, mid)
        key_k = lo

    # top-p over the survivors: mass(key > hi) < p·Z <= mass(key > lo), narrowed to the smallest such key
    threshold = key_k
    if p < 1:
        total = tl.zeros([], tl.float32)
        for v0 in range(0, V, BLOCK_V):
            m_v = v0 + o_v < V
            b_x = tl.load(p_in + v0 + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
            total += tl.sum(tl.where(m_v & (_order_key(b_x) >= key_k), tl.exp(b_x - x_max), 0.0), axis=0)
        target = p * total
        lo, hi = key_k - 1, key_max
        while hi - lo > 1:
            mid = lo + (hi - lo) // 2
            mass = tl.zeros([], tl.float32)
            for v0 in range(0, V, BLOCK_V):
                m_v = v0 + o_v < V
                b_x = tl.load(p_in + v0 + o_v, mask=m_v, other=float("-inf")).to(tl.float32)
                mass += tl.sum(tl.where(m_v & (_order_key(b_x) > mid), tl.exp(b_x - x_max), 0.0), axis=0)
            lo = tl.where(mass < target, lo, mid)
            hi = tl.where(mass < target, mid, hi)
        threshold = hi

    for v0 in range(0, V, BLOCK_V):
        m_v = v0 + o_v < V
        b_x = tl.load(p_in + v0 + o_v, mask=m_v, other=float("-inf"))
        b_keep = _order_key(b_x.to(tl.float32)) >= threshold
        tl.store(p_out + v0 + o_v, tl.where(b_keep, b_x, float("-inf")).to(out.dtype.element_ty), mask=m_v)


def top_k_top_p_filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's k highest logits, then the shortest prefix of those reaching mass p.

    Args:
        logits: ``[B, V]`` fp32 (or bf16; the probabilities are fp32 either way).
        top_k: ``[B]`` int64, tokens kept per row; 0 (or anything outside ``[1, V)``) is off.
        top_p: ``[B]`` fp32, mass kept per row in ``(0, 1]``; 1 is off.
    Returns:
        ``[B, V]`` filtered logits in ``logits``' dtype, filtered entries at -inf.
    """
    if logits.dim() != 2 or top_k.shape != logits.shape[:1] or top_p.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [B, V], top_k [B] and top_p [B], got {tuple(logits.shape)}, "
            f"{tuple(top_k.shape)} and {tuple(top_p.shape)}"
        )
    if logits.dtype not in DTYPES:
        raise KernelUnsupported(f"the triton top-k/top-p filter takes fp32/fp16/bf16 logits, got {logits.dtype}")
    if logits.device.type != "cuda" and not settings.switch("TRITON_INTERPRET"):
        raise KernelUnsupported(f"{logits.device.type} tensors need TRITON_INTERPRET=1 for the triton kernels")
    batch, vocab = logits.shape
    out = torch.empty_like(logits)
    if batch == 0:
        return out
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    block_v = min(triton.next_power_of_2(vocab), 4096)
    top_k_top_p_kernel[(batch,)](
        logits,
        out,
        top_k.to(torch.int64).contiguous(),
        top_p.to(torch.float32).contiguous(),
        vocab,
        logits.stride(0),
        out.stride(0),
        BLOCK_V=block_v,
        num_warps=8 if block_v >= 2048 else 4,
    )
    return out


@triton.jit
def token_bitmask_kernel(logits, bitmask, rows, V, W, stride_logits, fill, BLOCK_V: tl.constexpr):
    """One program per (bitmask row, block of tokens): clear tokens get ``fill``."""
    i_g = tl.program_id(0)
    o_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    m_v = o_v < V
    row = tl.load(rows + i_g)
    b_word = tl.load(bitmask + i_g * W + o_v // 32, mask=m_v, other=-1)
    b_clear = ((b_word >> (o_v % 32)) & 1) == 0
    p_row = logits + row * stride_logits
    tl.store(p_row + o_v, tl.full([BLOCK_V], fill, tl.float32).to(logits.dtype.element_ty), mask=m_v & b_clear)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """`reference.apply_token_bitmask` as one Triton launch: only the masked entries are written.

    Args:
        logits: ``[R, V]`` fp32/fp16/bf16, modified in place (its last dim contiguous).
        bitmask: ``[G, W]`` int32 (copied to the logits' device), ``W * 32 >= V``.
        rows: ``[G]`` int64, the logits row of each bitmask row.
    """
    if logits.dim() != 2 or bitmask.dim() != 2 or rows.shape != bitmask.shape[:1] or bitmask.shape[1] * 32 < logits.shape[1]:
        raise ValueError(
            f"expected logits [R, V], bitmask [G, W] with W * 32 >= V and rows [G], got {tuple(logits.shape)}, "
            f"{tuple(bitmask.shape)} and {tuple(rows.shape)}"
        )
    if logits.dtype not in DTYPES or logits.stride(-1) != 1:
        raise KernelUnsupported(f"the triton bitmask kernel takes fp32/fp16/bf16 logits with contiguous rows, got {logits.dtype}")
    if logits.device.type != "cuda" and not settings.switch("TRITON_INTERPRET"):
        raise KernelUnsupported(f"{logits.device.type} tensors need TRITON_INTERPRET=1 for the triton kernels")
    groups, words = bitmask.shape
    vocab = logits.shape[1]
    if groups == 0:
        return
    bitmask = bitmask.to(device=logits.device, dtype=torch.int32, non_blocking=True).contiguous()
    rows = rows.to(device=logits.device, dtype=torch.int64, non_blocking=True).contiguous()
    block_v = min(triton.next_power_of_2(vocab), 4096)
    token_bitmask_kernel[(groups, triton.cdiv(vocab, block_v))](
        logits, bitmask, rows, vocab, words, logits.stride(0), torch.finfo(logits.dtype).min, BLOCK_V=block_v,
    )
