"""mHC mixing weights, Sinkhorn and the stream collapse as one Triton kernel: one program per token.

The token's ``(2 + N) N`` logits sit in registers (``pre [N]``, ``post [N]``, ``comb [N, N]``); the
Sinkhorn iterations run there in fp32, then the collapse ``Σ_n pre[n] X[n]`` streams the token's
``[N, D]`` in blocks of channels. Same contract as the reference's `mhc_sinkhorn`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def mhc_sinkhorn_kernel(
    mixes, base, scale, streams, post_out, comb_out, collapsed,
    N, D, eps, iters,
    stride_mt, stride_st, stride_sn, stride_pt, stride_ct, stride_ot,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    o_n = tl.arange(0, BLOCK_N)
    m_n = o_n < N
    m_nn = m_n[:, None] & m_n[None, :]
    s_pre, s_post, s_comb = tl.load(scale), tl.load(scale + 1), tl.load(scale + 2)
    row = mixes + t * stride_mt
    pre = tl.load(row + o_n, mask=m_n, other=0.0) * s_pre + tl.load(base + o_n, mask=m_n, other=0.0)
    pre = tl.where(m_n, tl.sigmoid(pre) + eps, 0.0)
    post = tl.load(row + N + o_n, mask=m_n, other=0.0) * s_post + tl.load(base + N + o_n, mask=m_n, other=0.0)
    post = 2.0 * tl.sigmoid(post)
    cell = 2 * N + o_n[:, None] * N + o_n[None, :]
    comb = tl.load(row + cell, mask=m_nn, other=0.0) * s_comb + tl.load(base + cell, mask=m_nn, other=0.0)
    comb = tl.where(m_nn, comb, float("-inf"))
    top = tl.max(comb, axis=1)
    top = tl.where(m_n, top, 0.0)
    e = tl.where(m_nn, tl.exp(comb - top[:, None]), 0.0)
    denom = tl.sum(e, axis=1)
    comb = tl.where(m_nn, e / tl.where(m_n, denom, 1.0)[:, None] + eps, 0.0)
    comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    for _ in range(iters - 1):
        comb = comb / (tl.sum(comb, axis=1)[:, None] + eps)
        comb = comb / (tl.sum(comb, axis=0)[None, :] + eps)
    tl.store(post_out + t * stride_pt + o_n, post, mask=m_n)
    tl.store(comb_out + t * stride_ct + o_n[:, None] * N + o_n[None, :], comb, mask=m_nn)
    for d0 in range(0, D, BLOCK_D):
        o_d = d0 + tl.arange(0, BLOCK_D)
        m = m_n[:, None] & (o_d < D)[None, :]
        x = tl.load(streams + t * stride_st + o_n[:, None] * stride_sn + o_d[None, :], mask=m, other=0.0).to(tl.float32)
        tl.store(collapsed + t * stride_ot + o_d, tl.sum(pre[:, None] * x, axis=0).to(collapsed.dtype.element_ty), mask=o_d < D)


def mhc_sinkhorn(
    mixes: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, streams: torch.Tensor, eps: float, iters: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``post [T, N]``, ``comb [T, N, N]`` (fp32) and ``collapsed [T, D]`` (arguments as the reference's)."""
    T, N, D = streams.shape
    assert mixes.shape == (T, (2 + N) * N) and base.shape == ((2 + N) * N,) and scale.shape == (3,) and iters >= 1
    mixes = mixes.float().contiguous()
    base, scale = base.float().contiguous(), scale.float().contiguous()
    if streams.stride(-1) != 1:
        streams = streams.contiguous()
    post = torch.empty(T, N, dtype=torch.float32, device=streams.device)
    comb = torch.empty(T, N, N, dtype=torch.float32, device=streams.device)
    collapsed = torch.empty(T, D, dtype=streams.dtype, device=streams.device)
    if T == 0:
        return post, comb, collapsed
    mhc_sinkhorn_kernel[(T,)](
        mixes, base, scale, streams, post, comb, collapsed,
        N, D, float(eps), int(iters),
        mixes.stride(0), streams.stride(0), streams.stride(1), post.stride(0), comb.stride(0), collapsed.stride(0),
        BLOCK_N=max(2, triton.next_power_of_2(N)),
        BLOCK_D=min(256, max(16, triton.next_power_of_2(D))),
    )
    return post, comb, collapsed
