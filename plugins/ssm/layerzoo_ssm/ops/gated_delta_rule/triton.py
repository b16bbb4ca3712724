"""Gated delta rule in Triton: the same ops, signatures and math as ``reference.py``.

- `recurrent_gated_delta_rule`: one program per (sequence, head, block of ``BV`` value columns);
  the ``[K, BV]`` state tile stays in registers (fp32) while the program walks the sequence's
  tokens one by one.
- `chunk_gated_delta_rule`: one program per (sequence, head, value block) too, but walking the
  sequence ``BT = 64`` tokens at a time: inside a chunk it builds ``(I + A)⁻¹`` by forward
  substitution (row by row, in registers), forms ``U`` and ``W`` with ``tl.dot``, then reads and
  updates the carried state with matmuls (the UT/WY form of the reference). The chunk length is the
  kernel's own (the math is exact for any length); ``chunk_size`` only has to be accepted.

Both take a single sequence or a varlen batch (``cu_seqlens``) without a host sync, and compute in
fp32 whatever the storage dtype. ``K`` (the whole key dim sits in one tile) is at most 256.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels.triton_common import round_to
from layerzoo.kernels.varlen import check_state
from layerzoo.kernels.triton_varlen import check_supported, cu_or_dummy, dot, rows

MAX_K = 256
BT_CHUNK = 64
L2NORM_EPS = 1e-6


@triton.jit(do_not_specialize=["T"])
def recurrent_gdr_fwd_kernel(
    q, k, v, g, beta, o, h0, ht, cu_seqlens, scale, T,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2NORM: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos, eos = (i_n * T).to(tl.int64), (i_n * T + T).to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    # [BK, BV] state tile, fp32
    p_h = (i_nh * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(h0 + p_h, mask=m_kv, other=0.0)

    for t in range(bos, eos):
        # [BK], [BV], scalars
        b_q = tl.load(q + t * stride_qt + i_h * stride_qh + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + t * stride_kt + i_h * stride_kh + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + t * stride_vt + i_h * stride_vh + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_g = tl.load(g + t * stride_gt + i_h).to(tl.float32)
        b_b = tl.load(beta + t * stride_bt + i_h).to(tl.float32)
        if USE_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale
        b_h = b_h * tl.exp(b_g)
        # [BV]: the delta-rule write, then the read
        b_u = b_b * (b_v - tl.sum(b_h * b_k[:, None], 0))
        b_h += b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0)
        tl.store(o + (t * H + i_h) * V + o_v, round_to(b_o, o.dtype.element_ty), mask=m_v)

    tl.store(ht + p_h, b_h, mask=m_kv)


@triton.jit(do_not_specialize=["T"])
def chunk_gdr_fwd_kernel(
    q, k, v, g, beta, o, h0, ht, cu_seqlens, scale, T,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_bt,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_L2NORM: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos, eos = (i_n * T).to(tl.int64), (i_n * T + T).to(tl.int64)
    L = eos - bos

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    m_causal = o_t[:, None] >= o_t[None, :]  # j <= i
    m_strict = o_t[:, None] > o_t[None, :]  # j < i
    p_h = (i_nh * K + o_k[:, None]).to(tl.int64) * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)  # [BK, BV] state tile
    if HAS_H0:
        b_h += tl.load(h0 + p_h, mask=m_kv, other=0.0)

    for i_c in range(0, tl.cdiv(L, BT)):
        # rows past the sequence load as zeros (k = v = g = beta = 0): no write, no decay
        o_tt = bos + i_c * BT + o_t
        m_t = (i_c * BT + o_t) < L
        m_tk, m_tv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
        # [BT, BK], [BT, BK], [BT, BV], [BT], [BT]
        b_q = tl.load(q + o_tt[:, None] * stride_qt + i_h * stride_qh + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_k = tl.load(k + o_tt[:, None] * stride_kt + i_h * stride_kh + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_v = tl.load(v + o_tt[:, None] * stride_vt + i_h * stride_vh + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        b_g = tl.load(g + o_tt * stride_gt + i_h, mask=m_t, other=0.0).to(tl.float32)
        b_b = tl.load(beta + o_tt * stride_bt + i_h, mask=m_t, other=0.0).to(tl.float32)
        if USE_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None]
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
        b_q = b_q * scale

        # [BT]: chunk-local cumulative log decay G, and [BT, BT]: exp(G_i - G_j) for j <= i
        b_G = tl.cumsum(b_g, 0)
        b_G_last = tl.sum(b_g, 0)
        b_d = tl.where(m_causal, tl.exp(tl.where(m_causal, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
        # [BT, BT]: A_ij = beta_i (k_i . k_j) exp(G_i - G_j) for j < i
        b_A = tl.where(m_strict, b_b[:, None] * dot(b_k, tl.trans(b_k)) * b_d, 0.0)
        # [BT, BT]: Ti = (I + A)^-1 by forward substitution, Ti_i = e_i - sum_{j<i} A_ij Ti_j
        b_Ti = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
        for i in range(1, BT):
            b_a = tl.sum(tl.where(o_t[:, None] == i, b_A, 0.0), 0)  # row i of A, [BT] over j
            b_row = tl.where(o_t == i, 1.0, 0.0) - tl.sum(b_a[:, None] * b_Ti, 0)
            b_Ti = tl.where(o_t[:, None] == i, b_row[None, :], b_Ti)
        # [BT, BV] and [BT, BK]: U = Ti (beta v), W = Ti (beta exp(G) k); the writes u = U - W S
        b_U = dot(b_Ti, b_v * b_b[:, None])
        b_W = dot(b_Ti, b_k * (b_b * tl.exp(b_G))[:, None])
        b_u = b_U - dot(b_W, b_h)

        # [BT, BV]: o = exp(G) q S + (causal q k^T decay) u
        b_qk = tl.where(m_causal, dot(b_q, tl.trans(b_k)) * b_d, 0.0)
        b_o = dot(b_q * tl.exp(b_G)[:, None], b_h) + dot(b_qk, b_u)
        p_o = o + (o_tt[:, None] * H + i_h) * V + o_v[None, :]
        tl.store(p_o, round_to(b_o, o.dtype.element_ty), mask=m_tv)

        # S = exp(G_C) S + (exp(G_C - G) k)^T u
        b_kd = b_k * tl.exp(b_G_last - b_G)[:, None]
        b_h = b_h * tl.exp(b_G_last) + dot(tl.trans(b_kd), b_u)

    tl.store(ht + p_h, b_h, mask=m_kv)


def _launch(kernel, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, op, **meta):
    check_supported(op, [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)])
    T, H, K = k.shape
    V = v.shape[-1]
    if q.shape != k.shape or v.shape[:2] != (T, H) or g.shape != (T, H) or beta.shape != (T, H):
        raise ValueError(
            f"{op}: expects q, k [T, H, K], v [T, H, V], g, beta [T, H]; got q {list(q.shape)}, "
            f"k {list(k.shape)}, v {list(v.shape)}, g {list(g.shape)}, beta {list(beta.shape)}"
        )
    if K > MAX_K:
        raise KernelUnsupported(f"{op} in triton holds the key dim in one tile (K <= {MAX_K}), got K = {K}")
    N = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    check_state("initial_state", initial_state, (N, H, K, V))
    q, k, v, g, beta = rows(q), rows(k), rows(v), rows(g), rows(beta)
    o = torch.empty((T, H, V), dtype=v.dtype, device=v.device)
    ht = torch.empty((N, H, K, V), dtype=torch.float32, device=v.device)
    h0 = None if initial_state is None else initial_state.to(dtype=torch.float32).contiguous()
    if N == 0:
        return o, ht
    BK = max(16, triton.next_power_of_2(K))
    BV = max(16, min(32, triton.next_power_of_2(V)))
    grid = (N * H, triton.cdiv(V, BV))
    kernel[grid](
        q, k, v, g, beta, o, h0, ht, cu_or_dummy(cu_seqlens, v), float(scale), T,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), beta.stride(0),
        H=H, K=K, V=V, BK=BK, BV=BV,
        USE_L2NORM=bool(use_qk_l2norm), HAS_H0=h0 is not None, IS_VARLEN=cu_seqlens is not None, **meta,
    )
    return o, ht


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule one token at a time; see ``reference.recurrent_gated_delta_rule``.

    Args:
        q, k: ``[T, H, K]``; v: ``[T, H, V]``; g, beta: ``[T, H]`` (rows may be strided).
        scale: multiplies the (l2-normalised) ``q``.
        initial_state: ``[N, H, K, V]`` fp32 or None; cu_seqlens: ``[N + 1]`` int64 or None.

    Returns:
        ``(o [T, H, V] in v.dtype, final_state [N, H, K, V] fp32)``.
    """
    return _launch(
        recurrent_gdr_fwd_kernel, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm,
        "recurrent_gated_delta_rule", num_warps=1,
    )


def gated_delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence; see ``reference.gated_delta_rule_decode``. The recurrent kernel over
    ``cu_seqlens = arange(N + 1)`` (built on the device: no host read, capturable)."""
    cu = torch.arange(q.shape[0] + 1, dtype=torch.long, device=q.device)
    return recurrent_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=initial_state, cu_seqlens=cu, use_qk_l2norm=use_qk_l2norm)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule in chunks of 64 tokens; see ``reference.chunk_gated_delta_rule``.

    ``chunk_size`` is accepted for the shared signature: the kernel's chunk is always 64 (the
    result does not depend on it beyond rounding).
    """
    return _launch(
        chunk_gdr_fwd_kernel, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm,
        "chunk_gated_delta_rule", BT=BT_CHUNK, num_warps=4,
    )
