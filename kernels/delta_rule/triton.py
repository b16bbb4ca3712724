"""The gated delta rule in Triton: the same ops, signatures and math as ``reference.py``, for a
decay per head (``g [T, H]``, Gated DeltaNet) or per key channel (``g [T, H, K]``, KDA), chosen by
the constexpr ``PER_KEY`` so that each kind compiles to its own specialised kernel.

- `recurrent_delta_rule`: one program per (sequence, head, block of ``BV`` value columns); the
  ``[K, BV]`` state tile stays in registers (fp32) while the program walks the tokens one by one,
  decaying the state by ``exp(g_t)`` (a scalar, or row ``d`` by ``exp(g_t[d])``).
- `delta_rule_decode`: the same kernel, one token per program, reading and writing the state in the
  pool at ``slots[n]`` (in place: no gather or scatter around it, no host read).
- `chunk_delta_rule`: one program per (sequence, head, value block) too, walking the sequence a
  chunk at a time in the UT/WY form of the reference: ``(I + A)⁻¹`` by forward substitution in
  registers, the rest with ``tl.dot`` (fp32, IEEE). A per-head decay makes the pairwise decays a
  ``[BT, BT]`` tile and the key products matmuls, over 64-token chunks; a per-key decay needs the
  ``[BT, BT, K]`` tile of differences ``G_i - G_j`` (``exp(G) · exp(-G)`` would overflow for strong
  decays), so its chunk is 16 tokens. ``chunk_size`` only has to be accepted (the math is exact for
  any chunk length).

All take a varlen batch (``cu_seqlens``) without a host sync and compute in fp32 whatever the
storage dtype. ``K`` (the whole key dim sits in one tile) is at most 256; larger raises
`KernelUnsupported` and the registry runs the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels.delta_rule.reference import decay_kind
from layerzoo.kernels.triton_common import round_to
from layerzoo.kernels.triton_varlen import check_supported, cu_or_dummy, dot, rows, sequence_bounds
from layerzoo.kernels.varlen import check_state

MAX_K = 256
# tokens per chunk: [BT, BT] decay tiles for a per-head decay, [BT, BT, K] for a per-key one
BT_PER_HEAD = 64
BT_PER_KEY = 16


@triton.jit(do_not_specialize=["T"])
def recurrent_delta_rule_kernel(
    q, k, v, g, beta, o, h0, ht, cu_seqlens, slots, scale, T,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PER_KEY: tl.constexpr, USE_L2NORM: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr,
    USE_SLOTS: tl.constexpr,
):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = sequence_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    # the state's row: the sequence's own, or its pool slot (read and written in place)
    if USE_SLOTS:
        i_s = tl.load(slots + i_n).to(tl.int64)
    else:
        i_s = i_n.to(tl.int64)

    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    # [BK, BV] state tile, fp32
    p_h = ((i_s * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        b_h += tl.load(h0 + p_h, mask=m_kv, other=0.0)

    for t in range(bos, eos):
        # [BK], [BV], scalars
        b_q = tl.load(q + t * stride_qt + i_h * stride_qh + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_k = tl.load(k + t * stride_kt + i_h * stride_kh + o_k, mask=m_k, other=0.0).to(tl.float32)
        b_v = tl.load(v + t * stride_vt + i_h * stride_vh + o_v, mask=m_v, other=0.0).to(tl.float32)
        b_b = tl.load(beta + t * stride_bt + i_h).to(tl.float32)
        if PER_KEY:
            b_g = tl.load(g + t * stride_gt + i_h * stride_gh + o_k, mask=m_k, other=0.0).to(tl.float32)
            b_h = b_h * tl.exp(b_g)[:, None]
        else:
            b_h = b_h * tl.exp(tl.load(g + t * stride_gt + i_h * stride_gh).to(tl.float32))
        if USE_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q) + 1e-6)
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k) + 1e-6)
        b_q = b_q * scale
        # [BV]: the delta-rule write, then the read
        b_u = b_b * (b_v - tl.sum(b_h * b_k[:, None], 0))
        b_h += b_k[:, None] * b_u[None, :]
        b_o = tl.sum(b_h * b_q[:, None], 0)
        tl.store(o + (t * H + i_h) * V + o_v, round_to(b_o, o.dtype.element_ty), mask=m_v)

    tl.store(ht + p_h, b_h, mask=m_kv)


@triton.jit(do_not_specialize=["T"])
def chunk_delta_rule_kernel(
    q, k, v, g, beta, o, h0, ht, cu_seqlens, slots, scale, T,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_gt, stride_gh, stride_bt,
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    PER_KEY: tl.constexpr, USE_L2NORM: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr,
    USE_SLOTS: tl.constexpr,
):
    i_nh, i_v = tl.program_id(0), tl.program_id(1)
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = sequence_bounds(cu_seqlens, i_n, T, IS_VARLEN)
    L = eos - bos

    o_t = tl.arange(0, BT)
    o_k = tl.arange(0, BK)
    o_v = i_v * BV + tl.arange(0, BV)
    m_k, m_v = o_k < K, o_v < V
    m_kv = m_k[:, None] & m_v[None, :]
    m_causal = o_t[:, None] >= o_t[None, :]  # j <= i
    m_strict = o_t[:, None] > o_t[None, :]  # j < i
    p_h = ((i_n.to(tl.int64) * H + i_h) * K + o_k[:, None]) * V + o_v[None, :]
    b_h = tl.zeros([BK, BV], dtype=tl.float32)  # [BK, BV] state tile
    if HAS_H0:
        b_h += tl.load(h0 + p_h, mask=m_kv, other=0.0)

    for i_c in range(0, tl.cdiv(L, BT)):
        # rows past the sequence load as zeros (k = v = g = beta = 0): no write, no decay
        o_tt = bos + i_c * BT + o_t
        m_t = (i_c * BT + o_t) < L
        m_tk, m_tv = m_t[:, None] & m_k[None, :], m_t[:, None] & m_v[None, :]
        # [BT, BK], [BT, BK], [BT, BV], [BT]
        b_q = tl.load(q + o_tt[:, None] * stride_qt + i_h * stride_qh + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_k = tl.load(k + o_tt[:, None] * stride_kt + i_h * stride_kh + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
        b_v = tl.load(v + o_tt[:, None] * stride_vt + i_h * stride_vh + o_v[None, :], mask=m_tv, other=0.0).to(tl.float32)
        b_b = tl.load(beta + o_tt * stride_bt + i_h, mask=m_t, other=0.0).to(tl.float32)
        if USE_L2NORM:
            b_q = b_q * tl.rsqrt(tl.sum(b_q * b_q, 1) + 1e-6)[:, None]
            b_k = b_k * tl.rsqrt(tl.sum(b_k * b_k, 1) + 1e-6)[:, None]
        b_q = b_q * scale

        # G: the chunk-local cumulative log decay; kk, qk [BT, BT]: the key products weighted by
        # exp(G_i - G_j) (j <= i); eG, eGk: exp(G) and exp(G_C - G) broadcastable over [BT, BK];
        # hd: exp(G_C) broadcastable over the [BK, BV] state
        if PER_KEY:
            b_g = tl.load(g + o_tt[:, None] * stride_gt + i_h * stride_gh + o_k[None, :], mask=m_tk, other=0.0).to(tl.float32)
            b_G = tl.cumsum(b_g, 0)  # [BT, BK]
            b_G_last = tl.sum(b_g, 0)  # [BK]
            m_c3 = m_causal[:, :, None]
            b_d = tl.where(m_c3, tl.exp(tl.where(m_c3, b_G[:, None, :] - b_G[None, :, :], 0.0)), 0.0)
            b_kk = tl.sum(b_k[:, None, :] * b_k[None, :, :] * b_d, 2)
            b_qk = tl.sum(b_q[:, None, :] * b_k[None, :, :] * b_d, 2)
            b_eG = tl.exp(b_G)
            b_eGk = tl.exp(b_G_last[None, :] - b_G)
            b_hd = tl.exp(b_G_last)[:, None]
        else:
            b_g = tl.load(g + o_tt * stride_gt + i_h * stride_gh, mask=m_t, other=0.0).to(tl.float32)
            b_G = tl.cumsum(b_g, 0)  # [BT]
            b_G_last = tl.sum(b_g, 0)
            b_d = tl.where(m_causal, tl.exp(tl.where(m_causal, b_G[:, None] - b_G[None, :], 0.0)), 0.0)
            b_kk = dot(b_k, tl.trans(b_k)) * b_d
            b_qk = dot(b_q, tl.trans(b_k)) * b_d
            b_eG = tl.exp(b_G)[:, None]
            b_eGk = tl.exp(b_G_last - b_G)[:, None]
            b_hd = tl.exp(b_G_last)

        # [BT, BT]: A_ij = beta_i kk_ij (j < i); Ti = (I + A)^-1 by forward substitution,
        # Ti_i = e_i - sum_{j<i} A_ij Ti_j
        b_A = tl.where(m_strict, b_b[:, None] * b_kk, 0.0)
        b_Ti = tl.where(o_t[:, None] == o_t[None, :], 1.0, 0.0)
        for i in range(1, BT):
            b_a = tl.sum(tl.where(o_t[:, None] == i, b_A, 0.0), 0)  # row i of A, [BT] over j
            b_row = tl.where(o_t == i, 1.0, 0.0) - tl.sum(b_a[:, None] * b_Ti, 0)
            b_Ti = tl.where(o_t[:, None] == i, b_row[None, :], b_Ti)
        # [BT, BV] and [BT, BK]: U = Ti (beta v), W = Ti (beta exp(G) k); the writes u = U - W S
        b_U = dot(b_Ti, b_v * b_b[:, None])
        b_W = dot(b_Ti, b_k * b_eG * b_b[:, None])
        b_u = b_U - dot(b_W, b_h)

        # [BT, BV]: o = (exp(G) q) S + qk u
        b_o = dot(b_q * b_eG, b_h) + dot(b_qk, b_u)
        p_o = o + (o_tt[:, None] * H + i_h) * V + o_v[None, :]
        tl.store(p_o, round_to(b_o, o.dtype.element_ty), mask=m_tv)

        # S = diag(exp(G_C)) S + (exp(G_C - G) k)^T u
        b_h = b_h * b_hd + dot(tl.trans(b_k * b_eGk), b_u)

    tl.store(ht + p_h, b_h, mask=m_kv)


def _launch(kernel, op, q, k, v, g, beta, scale, h0, ht, *, N, T, cu_seqlens, slots, use_qk_l2norm, **meta):
    """Check a call, then run ``kernel`` over ``N`` sequences × ``H`` heads × value blocks;
    returns ``o [T·N or T, H, V]`` (``ht`` is written by the kernel)."""
    check_supported(op, [("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)])
    per_key = decay_kind(q, k, v, g, beta, op)
    rows_, H, K = k.shape
    V = v.shape[-1]
    if K > MAX_K:
        raise KernelUnsupported(f"{op} in triton holds the key dim in one tile (K <= {MAX_K}), got K = {K}")
    q, k, v, g, beta = rows(q), rows(k), rows(v), rows(g), rows(beta)
    o = torch.empty((rows_, H, V), dtype=v.dtype, device=v.device)
    if N == 0:
        return o
    BK = max(16, triton.next_power_of_2(K))
    BV = max(16, min(32, triton.next_power_of_2(V)))
    grid = (N * H, triton.cdiv(V, BV))
    kernel[grid](
        q, k, v, g, beta, o, h0, ht, cu_or_dummy(cu_seqlens, v), cu_or_dummy(slots, v), float(scale), T,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1),
        beta.stride(0),
        H=H, K=K, V=V, BK=BK, BV=BV, PER_KEY=per_key, USE_L2NORM=bool(use_qk_l2norm), HAS_H0=h0 is not None,
        IS_VARLEN=cu_seqlens is not None, USE_SLOTS=slots is not None, **meta,
    )
    return o


def _varlen(kernel, op, q, k, v, g, beta, scale, initial_state, cu_seqlens, use_qk_l2norm, **meta):
    """The prefill calls: one sequence or a varlen batch, state in and out."""
    T, H, K = k.shape
    V = v.shape[-1]
    N = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    check_state("initial_state", initial_state, (N, H, K, V))
    ht = torch.empty((N, H, K, V), dtype=torch.float32, device=v.device)
    h0 = None if initial_state is None else initial_state.to(dtype=torch.float32).contiguous()
    o = _launch(
        kernel, op, q, k, v, g, beta, scale, h0, ht,
        N=N, T=T, cu_seqlens=cu_seqlens, slots=None, use_qk_l2norm=use_qk_l2norm, **meta,
    )
    return o, ht


def recurrent_delta_rule(
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
    """The gated delta rule one token at a time; see ``reference.recurrent_delta_rule``.

    Args:
        q, k: ``[T, H, K]``; v: ``[T, H, V]``; g: ``[T, H]`` or ``[T, H, K]``; beta: ``[T, H]``
            (rows may be strided).
        scale: multiplies the (l2-normalised) ``q``.
        initial_state: ``[N, H, K, V]`` fp32 or None; cu_seqlens: ``[N + 1]`` int64 or None.

    Returns:
        ``(o [T, H, V] in v.dtype, final_state [N, H, K, V] fp32)``.
    """
    return _varlen(
        recurrent_delta_rule_kernel, "recurrent_delta_rule", q, k, v, g, beta, scale, initial_state, cu_seqlens,
        use_qk_l2norm, num_warps=1,
    )


def delta_rule_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float,
    state: torch.Tensor,
    slots: torch.Tensor,
    use_qk_l2norm: bool = True,
) -> torch.Tensor:
    """One token per sequence, its state read and written in place in the pool at ``slots[n]``; see
    ``reference.delta_rule_decode``. No host read: a captured decode step can hold it.

    Args:
        q, k: ``[N, H, K]``; v: ``[N, H, V]``; g: ``[N, H]`` or ``[N, H, K]``; beta: ``[N, H]``.
        state: the pool ``[P, H, K, V]`` fp32, contiguous; slots: ``[N]`` int64.

    Returns:
        ``o [N, H, V]`` in ``v.dtype``.
    """
    H, K, V = *k.shape[1:], v.shape[-1]
    if state.dim() != 4 or tuple(state.shape[1:]) != (H, K, V):
        raise ValueError(f"state must be a pool [P, {H}, {K}, {V}], got {list(state.shape)}")
    if state.dtype != torch.float32 or not state.is_contiguous():
        raise KernelUnsupported(f"delta_rule_decode in triton updates a contiguous fp32 pool in place, got {state.dtype}")
    return _launch(
        recurrent_delta_rule_kernel, "delta_rule_decode", q, k, v, g, beta, scale, state, state,
        N=q.shape[0], T=1, cu_seqlens=None, slots=slots, use_qk_l2norm=use_qk_l2norm, num_warps=1,
    )


def chunk_delta_rule(
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
    """The gated delta rule in chunks; see ``reference.chunk_delta_rule``. ``chunk_size`` is accepted
    for the shared signature: the kernel's chunk is its own (64 tokens for a per-head decay, 16 for a
    per-key one; the result does not depend on it beyond rounding)."""
    BT = BT_PER_KEY if g.dim() == 3 else BT_PER_HEAD
    return _varlen(
        chunk_delta_rule_kernel, "chunk_delta_rule", q, k, v, g, beta, scale, initial_state, cu_seqlens,
        use_qk_l2norm, BT=BT, num_warps=4,
    )
