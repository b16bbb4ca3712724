"""k-pool compression as one Triton kernel: one program per (pool, block of channels).

The pool's ``[k, BLOCK_D]`` gate scores and keys are loaded once; the softmax over the ``k`` slots
runs per channel in fp32 (slots past the pool's count at ``-inf``), then the weighted sum of the
keys. Same contract as the reference's `kpool_compress`; the sum runs in fp32 (the reference's in the
keys' dtype), so the two agree exactly in fp32 and to rounding in bf16.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def kpool_compress_kernel(
    keys, gates, ape, counts, out,
    K, D,
    stride_kp, stride_kk,
    stride_gp, stride_gk,
    stride_ak,
    stride_op,
    BLOCK_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    i_p, i_d = tl.program_id(0), tl.program_id(1)
    o_k = tl.arange(0, BLOCK_K)
    o_d = i_d * BLOCK_D + tl.arange(0, BLOCK_D)
    count = tl.load(counts + i_p)
    m_k = (o_k < K) & (o_k < count)
    m = m_k[:, None] & (o_d < D)[None, :]
    b_g = tl.load(gates + i_p * stride_gp + o_k[:, None] * stride_gk + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_a = tl.load(ape + o_k[:, None] * stride_ak + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    b_k = tl.load(keys + i_p * stride_kp + o_k[:, None] * stride_kk + o_d[None, :], mask=m, other=0.0).to(tl.float32)
    logits = tl.where(m_k[:, None], b_g + b_a, float("-inf"))
    top = tl.max(logits, axis=0)  # [BLOCK_D]; -inf for an empty pool
    top = tl.where(top == float("-inf"), 0.0, top)
    e = tl.where(m_k[:, None], tl.exp(logits - top[None, :]), 0.0)
    denom = tl.sum(e, axis=0)
    pooled = tl.sum(e * b_k, axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out + i_p * stride_op + o_d, pooled.to(out.dtype.element_ty), mask=o_d < D)


def kpool_compress(keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
    """``[P, D]`` pooled keys (arguments as the reference's `kpool_compress`)."""
    P, k, D = keys.shape
    assert gates.shape == keys.shape and ape.shape == (k, D) and counts.shape == (P,), (keys.shape, gates.shape, ape.shape, counts.shape)
    out = torch.empty(P, D, dtype=keys.dtype, device=keys.device)
    if P == 0:
        return out
    keys, gates, ape, counts = keys.contiguous(), gates.contiguous(), ape.contiguous(), counts.contiguous()
    BLOCK_D = min(128, max(16, triton.next_power_of_2(D)))
    kpool_compress_kernel[(P, triton.cdiv(D, BLOCK_D))](
        keys, gates, ape, counts, out,
        k, D,
        keys.stride(0), keys.stride(1),
        gates.stride(0), gates.stride(1),
        ape.stride(0),
        out.stride(0),
        BLOCK_K=max(2, triton.next_power_of_2(k)),
        BLOCK_D=BLOCK_D,
    )
    return out
