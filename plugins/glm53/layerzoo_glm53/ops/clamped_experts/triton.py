"""Routed experts with the clamped SwiGLU as a grouped GEMM in Triton, with no host sync (a decode
step that runs it can be captured).

The core's ``moe_grouped_matmul`` pipeline (`layerzoo.kernels.moe_grouped_matmul.triton`): pairs
aligned by expert with torch ops (``align_by_expert``), then ``gate_up`` per row block, then the
core's ``down_kernel`` times the routing weight, and the k rows of each token summed in fp32. Only
the gate/up kernel is this op's own: it clamps the gate from above and the up projection on both
sides at ``limit`` before ``silu(gate) · up``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerzoo import settings
from layerzoo.errors import KernelUnsupported
from layerzoo.kernels.moe_grouped_matmul.triton import align_by_expert, down_kernel

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _interpreting() -> bool:
    return settings.switch("TRITON_INTERPRET")


@triton.jit
def clamped_gate_up_kernel(
    x, w13, h, pair_of_row, expert_of_block,
    num_pairs, H, I, limit,
    stride_xt, stride_we, stride_wn, stride_hm,
    TOP_K: tl.constexpr,
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
    p_w = w13 + i_e * stride_we + o_n[None, :] * stride_wn  # gate rows o_n, up rows I + o_n, as [BLOCK_K, BLOCK_N]
    b_gate = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    b_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        o_k = k0 + tl.arange(0, BLOCK_K)
        m_k = o_k < H
        b_x = tl.load(x + b_token[:, None] * stride_xt + o_k[None, :], mask=m_m[:, None] & m_k[None, :], other=0.0)
        b_wg = tl.load(p_w + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)
        b_wu = tl.load(p_w + I * stride_wn + o_k[:, None], mask=m_k[:, None] & m_n[None, :], other=0.0)
        if UPCAST:
            b_x, b_wg, b_wu = b_x.to(tl.float32), b_wg.to(tl.float32), b_wu.to(tl.float32)
        b_gate = tl.dot(b_x, b_wg, b_gate, input_precision=PRECISION)
        b_up = tl.dot(b_x, b_wu, b_up, input_precision=PRECISION)
    b_gate = tl.minimum(b_gate, limit)
    b_up = tl.minimum(tl.maximum(b_up, -limit), limit)
    b_h = b_gate * tl.sigmoid(b_gate) * b_up
    tl.store(h + o_m[:, None] * stride_hm + o_n[None, :], b_h.to(h.dtype.element_ty), mask=m_m[:, None] & m_n[None, :])


def clamped_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, limit: float
) -> torch.Tensor:
    """``[T, H]`` (same contract as the reference's `clamped_experts`)."""
    num_tokens, hidden = x.shape
    num_experts, inter = w13.shape[0], w13.shape[1] // 2
    top_k = ids.shape[1]
    assert w13.shape == (num_experts, 2 * inter, hidden) and w2.shape == (num_experts, hidden, inter), (w13.shape, w2.shape)
    assert weights.shape == ids.shape and ids.shape[0] == num_tokens, (weights.shape, ids.shape)
    if x.dtype not in DTYPES or w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise KernelUnsupported(f"clamped_experts in triton needs x, w13, w2 in one fp32/fp16/bf16 dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if x.device.type != "cuda" and not _interpreting():
        raise KernelUnsupported(f"{x.device.type} tensors need TRITON_INTERPRET=1 for the triton kernels")
    if num_tokens == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    weights, ids = weights.contiguous(), ids.contiguous()
    num_pairs = num_tokens * top_k
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    block_n, block_k = 64, 32
    pair_of_row, expert_of_block = align_by_expert(ids, num_experts, block_m)
    num_blocks = expert_of_block.numel()
    upcast = _interpreting() and x.dtype != torch.float32
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    h = torch.empty(pair_of_row.numel(), inter, dtype=x.dtype, device=x.device)
    clamped_gate_up_kernel[(num_blocks, triton.cdiv(inter, block_n))](
        x, w13, h, pair_of_row, expert_of_block, num_pairs, hidden, inter, float(limit),
        x.stride(0), w13.stride(0), w13.stride(1), h.stride(0),
        TOP_K=top_k, UPCAST=upcast, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    out = torch.empty(num_pairs, hidden, dtype=torch.float32, device=x.device)
    down_kernel[(num_blocks, triton.cdiv(hidden, block_n))](
        h, w2, weights, out, pair_of_row, expert_of_block, num_pairs, hidden, inter,
        h.stride(0), w2.stride(0), w2.stride(1), out.stride(0),
        UPCAST=upcast, PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )
    return out.view(num_tokens, top_k, hidden).sum(dim=1).to(x.dtype)
