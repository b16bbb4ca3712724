"""Routed SwiGLU experts as a grouped GEMM in Triton.

1. Align (torch ops, no host sync): the ``T*k`` (token, expert) pairs are sorted by expert and
   each expert's rows are padded to a multiple of ``BLOCK_M``, so that every row block belongs to
   one expert. ``pair_of_row [P]`` names the pair of each sorted row (``T*k`` on padding rows) and
   ``expert_of_block [P / BLOCK_M]`` the expert of each block (-1 on the spare blocks past the
   last expert: ``P`` is an upper bound, ``T*k + min(E, T*k) * (BLOCK_M - 1)``).
2. ``gate_up_kernel``: ``h = silu(x Wgᵀ) · (x Wuᵀ)`` per row block, ``h [P, I]`` in ``x``'s dtype
   (with ``limit``, GLM-5.3-Flash's clamped SwiGLU: the gate clamped from above, up on both sides).
3. ``down_kernel``: ``weight · (h Wdᵀ)`` in fp32, written to the row of its pair, ``[T*k, H]``.
4. The k contributions of each token are summed in fp32 (a deterministic sum, no atomics).

Under ``TRITON_INTERPRET=1`` bf16 tiles are upcast to fp32 before ``tl.dot`` (the interpreter
gets bf16 dots wrong); on a GPU they go to the tensor cores as they are, accumulating in fp32.
Weights in another dtype than ``x`` (e.g. fp8 experts) raise `KernelUnsupported`: the op then runs
its torch reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerzoo import settings
from layerzoo.errors import KernelUnsupported

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _interpreting() -> bool:
    return settings.switch("TRITON_INTERPRET")


@triton.jit
def gate_up_kernel(
    x,
    w13,
    h,
    pair_of_row,
    expert_of_block,
    num_pairs,
    H,
    I,
    limit,
    stride_xt,
    stride_we,
    stride_wn,
    stride_hm,
    TOP_K: tl.constexpr,
    CLAMP: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    i_e = tl.load(expert_of_block + i_m)
    if i_e < 0:
        return
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    b_pair = tl.load(pair_of_row + o_m)
    m_m = b_pair < num_pairs
    b_token = b_pair // TOP_K
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < I
    # the expert's gate rows o_n and up rows I + o_n, read transposed as [BLOCK_K, BLOCK_N]
    p_w = w13 + i_e * stride_we + o_n[None, :] * stride_wn

    b_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        # [BLOCK_M, BLOCK_K]
        b_x = tl.load(x + b_token[:, None] * stride_xt + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        # [BLOCK_K, BLOCK_N]
        b_wg = tl.load(p_w + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_wu = tl.load(p_w + I * stride_wn + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)
        if UPCAST:
            b_x, b_wg, b_wu = b_x.to(tl.float32), b_wg.to(tl.float32), b_wu.to(tl.float32)
        # [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N] -> [BLOCK_M, BLOCK_N]
        b_gate = tl.dot(b_x, b_wg, b_gate, input_precision=PRECISION)
        b_up = tl.dot(b_x, b_wu, b_up, input_precision=PRECISION)

    if CLAMP:
        b_gate = tl.minimum(b_gate, limit)
        b_up = tl.minimum(tl.maximum(b_up, -limit), limit)
    b_h = b_gate * tl.sigmoid(b_gate) * b_up
    p_h = h + o_m[:, None] * stride_hm + o_n[None, :]
    tl.store(p_h, b_h.to(h.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


@triton.jit
def down_kernel(
    h,
    w2,
    weights,
    out,
    pair_of_row,
    expert_of_block,
    num_pairs,
    H,
    I,
    stride_hm,
    stride_we,
    stride_wn,
    stride_om,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    i_e = tl.load(expert_of_block + i_m)
    if i_e < 0:
        return
    o_m = i_m * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
    b_pair = tl.load(pair_of_row + o_m)
    m_m = b_pair < num_pairs
    o_n = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_n = o_n < H
    # the expert's down rows o_n, read transposed as [BLOCK_K, BLOCK_N]
    p_w = w2 + i_e * stride_we + o_n[None, :] * stride_wn

    b_o = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < I
        # [BLOCK_M, BLOCK_K]
        b_h = tl.load(h + o_m[:, None] * stride_hm + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        # [BLOCK_K, BLOCK_N]
        b_w = tl.load(p_w + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)
        if UPCAST:
            b_h, b_w = b_h.to(tl.float32), b_w.to(tl.float32)
        # [BLOCK_M, BLOCK_K] @ [BLOCK_K, BLOCK_N] -> [BLOCK_M, BLOCK_N]
        b_o = tl.dot(b_h, b_w, b_o, input_precision=PRECISION)

    # [BLOCK_M] routing weight of each row's pair (weights [T, k] is contiguous: pair = flat index)
    b_rw = tl.load(weights + b_pair, mask=m_m, other=0.0).to(tl.float32)
    b_o = b_o * b_rw[:, None]
    tl.store(out + b_pair[:, None] * stride_om + o_n[None, :], b_o, mask=m_m[:, None] & m_n[None, :])


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted, padded row layout of the pairs: ``(pair_of_row [P], expert_of_block [P / block_m])``.

    Pair ``p`` is ``(token p // k, slot p % k)``; padding rows hold ``T*k``; spare blocks hold -1.
    """
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    start = torch.cumsum(counts, 0) - counts
    expert_sorted = flat[order]
    # row of each sorted pair: the expert's padded start plus the pair's rank within the expert
    row = padded_start[expert_sorted] + torch.arange(num_pairs, device=ids.device) - start[expert_sorted]

    rows = triton.cdiv(num_pairs + min(num_experts, num_pairs) * (block_m - 1), block_m) * block_m
    pair_of_row = torch.full((rows,), num_pairs, dtype=torch.int64, device=ids.device).index_copy_(0, row, order)
    block_start = torch.arange(0, rows, block_m, device=ids.device)
    expert_of_block = torch.searchsorted(padded_end, block_start, right=True)
    expert_of_block = torch.where(expert_of_block < num_experts, expert_of_block, -1)
    return pair_of_row, expert_of_block


def _block_m(num_pairs: int, num_experts: int) -> int:
    """Row block: small when each expert gets few rows (decode), larger when it gets many."""
    rows_per_expert = num_pairs / num_experts
    return 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 32 else 64


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    *, limit: float | None = None,
) -> torch.Tensor:
    """``out[t] = Σ_j weights[t, j] · down_e(silu(gate_e(x[t])) · up_e(x[t]))`` with ``e = ids[t, j]``
    (with ``limit``: ``silu(min(gate, limit)) · clamp(up, -limit, limit)``).

    Args:
        x: ``[T, H]`` tokens (fp32, bf16 or fp16).
        w13: ``[E, 2I, H]``, each expert's gate rows (the first ``I``) over its up rows, ``x``'s dtype.
        w2: ``[E, H, I]``, each expert's down projection, ``x``'s dtype.
        weights: ``[T, k]`` routing weights (any float dtype; applied in fp32).
        ids: ``[T, k]`` int64 expert ids in ``[0, E)``.
        limit: None (plain SwiGLU) or the clamp of GLM-5.3-Flash's experts.
    Returns:
        ``[T, H]`` in ``x``'s dtype; the k contributions of a token are summed in fp32.
    """
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = ids.shape[1]
    if w13.shape != (num_experts, 2 * inter, hidden) or w2.shape != (num_experts, hidden, inter):
        raise ValueError(
            f"expected w13 [E, 2I, H] and w2 [E, H, I] with H={hidden}, got {tuple(w13.shape)} and {tuple(w2.shape)}"
        )
    if weights.shape != ids.shape or ids.shape[0] != num_tokens:
        raise ValueError(
            f"expected weights and ids [T={num_tokens}, k], got {tuple(weights.shape)} and {tuple(ids.shape)}"
        )
    if x.dtype not in DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise KernelUnsupported(
            f"the triton grouped GEMM needs x, w13 and w2 in one of fp32/fp16/bf16, "
            f"got {x.dtype}, {w13.dtype} and {w2.dtype}"
        )
    if x.device.type != "cuda" and not _interpreting():
        raise KernelUnsupported(f"{x.device.type} tensors need TRITON_INTERPRET=1 for the triton kernels")
    if num_tokens == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights, ids = weights.contiguous(), ids.contiguous()

    num_pairs = num_tokens * top_k
    block_m, block_n, block_k = _block_m(num_pairs, num_experts), 64, 32
    pair_of_row, expert_of_block = align_by_expert(ids, num_experts, block_m)
    num_blocks = expert_of_block.numel()
    upcast = _interpreting() and x.dtype != torch.float32
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # exact fp32 products for fp32 models

    h = torch.empty(pair_of_row.numel(), inter, dtype=x.dtype, device=x.device)
    gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, h, pair_of_row, expert_of_block, num_pairs, hidden, inter, float(limit or 0.0),
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, CLAMP=limit is not None, UPCAST=upcast, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, w2, weights, out, pair_of_row, expert_of_block, num_pairs, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        UPCAST=upcast, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
