"""DSA lightning-indexer scores as a Triton kernel, then the causal top-k on the device.

One program per (batch row, query row, block of ``BLOCK_L`` keys): the query's ``[H, D]`` heads
against the block's keys in one fp32 ``dot`` (IEEE, no TF32: the selection must agree with the fp32
reference), ReLU after the scale, the head-weighted sum, ``-inf`` past the query's position. The
``[B, n, L]`` scores then go through ``torch.topk`` on the same device: no host round trip.

Scores equal the reference's up to fp32 summation order, so picks may differ from it only where
two scores at the cut are within rounding of each other (as between any two fp32 engines).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def dsa_index_scores_kernel(
    q, w, keys, q_pos, out,
    L, H, D,
    stride_qb, stride_qn, stride_qh,
    stride_wb, stride_wn,
    stride_kb, stride_kl,
    stride_pb,
    stride_ob, stride_on,
    scale,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_L: tl.constexpr,
):
    i_b, i_n, i_l = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    o_h = tl.arange(0, BLOCK_H)
    o_d = tl.arange(0, BLOCK_D)
    o_l = i_l * BLOCK_L + tl.arange(0, BLOCK_L)
    m_h, m_d, m_l = o_h < H, o_d < D, o_l < L
    b_q = tl.load(
        q + i_b * stride_qb + i_n * stride_qn + o_h[:, None] * stride_qh + o_d[None, :],
        mask=m_h[:, None] & m_d[None, :], other=0.0,
    ).to(tl.float32)
    b_k = tl.load(keys + i_b * stride_kb + o_l[:, None] * stride_kl + o_d[None, :], mask=m_l[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    b_s = tl.maximum(tl.dot(b_q, tl.trans(b_k), input_precision="ieee") * scale, 0.0)  # [BLOCK_H, BLOCK_L]
    b_w = tl.load(w + i_b * stride_wb + i_n * stride_wn + o_h, mask=m_h, other=0.0).to(tl.float32)
    b_score = tl.sum(b_s * b_w[:, None], axis=0)  # [BLOCK_L]
    pos = tl.load(q_pos + i_b * stride_pb + i_n)
    b_score = tl.where(o_l <= pos, b_score, float("-inf"))
    tl.store(out + i_b * stride_ob + i_n * stride_on + o_l, b_score, mask=m_l)


def dsa_indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, q_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """``[B, n, L]`` fp32 index scores (see the reference's `dsa_indexer_topk` for the arguments)."""
    B, n, H, D = q.shape
    L = keys.shape[1]
    assert weights.shape == (B, n, H) and keys.shape == (B, L, D) and q_positions.shape == (B, n)
    q, keys = q.contiguous(), keys.contiguous()
    weights, q_positions = weights.float().contiguous(), q_positions.contiguous()
    out = torch.empty(B, n, L, dtype=torch.float32, device=q.device)
    BLOCK_L = 64
    grid = (B, n, triton.cdiv(L, BLOCK_L))
    dsa_index_scores_kernel[grid](
        q, weights, keys, q_positions, out,
        L, H, D,
        q.stride(0), q.stride(1), q.stride(2),
        weights.stride(0), weights.stride(1),
        keys.stride(0), keys.stride(1),
        q_positions.stride(0),
        out.stride(0), out.stride(1),
        scale,
        BLOCK_H=max(16, triton.next_power_of_2(H)),
        BLOCK_D=max(16, triton.next_power_of_2(D)),
        BLOCK_L=BLOCK_L,
    )
    return out


def dsa_indexer_topk(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, q_positions: torch.Tensor, top_k: int, scale: float
) -> torch.Tensor:
    """``[B, n, top_k]`` int64 selected key positions (same contract as the reference)."""
    assert 1 <= top_k <= keys.shape[1], (top_k, keys.shape)
    return dsa_indexer_scores(q, weights, keys, q_positions, scale).topk(top_k, dim=-1).indices
