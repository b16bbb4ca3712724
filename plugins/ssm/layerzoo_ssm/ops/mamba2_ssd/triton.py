"""Mamba2 SSD in Triton: the same ops, signatures and math as ``reference.py``.

- `ssd_chunk_scan`: one program per (sequence, head, block of ``BP`` head dims), walking the
  sequence ``BT = 64`` tokens at a time with the ``[BP, N]`` state tile in registers (fp32): each
  chunk's output is ``(causal decayed C Bᵀ ⊙ dt) x`` plus the carried state read through ``C``,
  and the state is decayed and written with one matmul (the reference's chunked form). The
  kernel's chunk length is its own; ``chunk_size`` (256 for Mamba2) is accepted for the shared
  signature and only changes rounding.
- `selective_state_update`: one program per (sequence, head, ``BP`` block), a single step.

Varlen without a host sync; ``N`` (the state size, one tile) is at most 256.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels.triton_common import round_to
from layerzoo.kernels.triton_varlen import check_supported, cu_or_dummy, dot, rows, sequence_bounds
from layerzoo.kernels.varlen import check_state
from layerzoo_ssm.ops.mamba2_ssd.reference import _check

MAX_N = 256
BT_CHUNK = 64


@triton.jit(do_not_specialize=["T"])
def ssd_chunk_scan_kernel(
    x, dt, A, B, C, D, y, h0, ht, cu_seqlens, T,
    stride_xt, stride_xh, stride_dt, stride_bt, stride_bg, stride_ct, stride_cg,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
    BT: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_D: tl.constexpr, HAS_H0: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_sh, i_p = tl.program_id(0), tl.program_id(1)
    i_s, i_h = i_sh // H, i_sh % H
    i_g = i_h // (H // G)
    bos, eos = sequence_bounds(cu_seqlens, i_s, T, IS_VARLEN)
    L = eos - bos

    o_t = tl.arange(0, BT)
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p, m_n = o_p < P, o_n < N
    m_pn = m_p[:, None] & m_n[None, :]
    m_causal = o_t[:, None] >= o_t[None, :]  # s <= t
    b_A = tl.load(A + i_h).to(tl.float32)
    if HAS_D:
        b_D = tl.load(D + i_h).to(tl.float32)
    p_h = (i_sh * P + o_p[:, None]).to(tl.int64) * N + o_n[None, :]
    b_h = tl.zeros([BP, BN], dtype=tl.float32)  # [BP, BN] state tile
    if HAS_H0:
        b_h += tl.load(h0 + p_h, mask=m_pn, other=0.0)

    for i_c in range(0, tl.cdiv(L, BT)):
        # rows past the sequence load as zeros (dt = 0): no decay, no write
        o_tt = bos + i_c * BT + o_t
        m_t = (i_c * BT + o_t) < L
        m_tp, m_tn = m_t[:, None] & m_p[None, :], m_t[:, None] & m_n[None, :]
        # [BT, BP], [BT], [BT, BN], [BT, BN]
        b_x = tl.load(x + o_tt[:, None] * stride_xt + i_h * stride_xh + o_p[None, :], mask=m_tp, other=0.0).to(tl.float32)
        b_dt = tl.load(dt + o_tt * stride_dt + i_h, mask=m_t, other=0.0).to(tl.float32)
        b_B = tl.load(B + o_tt[:, None] * stride_bt + i_g * stride_bg + o_n[None, :], mask=m_tn, other=0.0).to(tl.float32)
        b_C = tl.load(C + o_tt[:, None] * stride_ct + i_g * stride_cg + o_n[None, :], mask=m_tn, other=0.0).to(tl.float32)

        # [BT]: chunk-local cumulative log decay; [BT, BT]: exp(lam_t - lam_s) dt_s (C_t . B_s), s <= t
        b_a = b_dt * b_A
        b_lam = tl.cumsum(b_a, 0)
        b_lam_end = tl.sum(b_a, 0)
        b_decay = tl.where(m_causal, tl.exp(tl.where(m_causal, b_lam[:, None] - b_lam[None, :], 0.0)), 0.0)
        b_M = dot(b_C, tl.trans(b_B)) * b_decay * b_dt[None, :]
        # [BT, BP]
        b_y = dot(b_M, b_x) + dot(b_C, tl.trans(b_h)) * tl.exp(b_lam)[:, None]
        if HAS_D:
            b_y += b_D * b_x
        p_y = y + (o_tt[:, None] * H + i_h) * P + o_p[None, :]
        tl.store(p_y, round_to(b_y, y.dtype.element_ty), mask=m_tp)

        # h = exp(lam_end) h + (x * dt exp(lam_end - lam))^T B
        b_xw = b_x * (b_dt * tl.exp(b_lam_end - b_lam))[:, None]
        b_h = b_h * tl.exp(b_lam_end) + dot(tl.trans(b_xw), b_B)

    tl.store(ht + p_h, b_h, mask=m_pn)


@triton.jit
def selective_state_update_kernel(
    state, x, dt, A, B, C, D, y, new_state,
    stride_sb, stride_sh, stride_sp, stride_xb, stride_xh, stride_db, stride_bb, stride_bg, stride_cb, stride_cg,
    H: tl.constexpr, G: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BP: tl.constexpr, BN: tl.constexpr,
    HAS_D: tl.constexpr,
):
    i_bh, i_p = tl.program_id(0), tl.program_id(1)
    i_b, i_h = (i_bh // H).to(tl.int64), i_bh % H
    i_g = i_h // (H // G)
    o_p = i_p * BP + tl.arange(0, BP)
    o_n = tl.arange(0, BN)
    m_p, m_n = o_p < P, o_n < N
    m_pn = m_p[:, None] & m_n[None, :]
    # [BP, BN], [BP], [BN], [BN], scalars
    p_s = state + i_b * stride_sb + i_h * stride_sh + o_p[:, None] * stride_sp + o_n[None, :]
    b_h = tl.load(p_s, mask=m_pn, other=0.0).to(tl.float32)
    b_x = tl.load(x + i_b * stride_xb + i_h * stride_xh + o_p, mask=m_p, other=0.0).to(tl.float32)
    b_B = tl.load(B + i_b * stride_bb + i_g * stride_bg + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_C = tl.load(C + i_b * stride_cb + i_g * stride_cg + o_n, mask=m_n, other=0.0).to(tl.float32)
    b_dt = tl.load(dt + i_b * stride_db + i_h).to(tl.float32)
    b_A = tl.load(A + i_h).to(tl.float32)

    b_h = b_h * tl.exp(b_dt * b_A) + (b_dt * b_x)[:, None] * b_B[None, :]
    b_y = tl.sum(b_h * b_C[None, :], 1)
    if HAS_D:
        b_y += tl.load(D + i_h).to(tl.float32) * b_x
    tl.store(y + (i_bh * P + o_p).to(tl.int64), round_to(b_y, y.dtype.element_ty), mask=m_p)
    p_new = new_state + (i_bh * P + o_p[:, None]).to(tl.int64) * N + o_n[None, :]
    tl.store(p_new, b_h, mask=m_pn)


def _blocks(op: str, P: int, N: int) -> tuple[int, int]:
    if N > MAX_N:
        raise KernelUnsupported(f"{op} in triton holds the state size in one tile (N <= {MAX_N}), got N = {N}")
    return max(16, min(32, triton.next_power_of_2(P))), max(16, triton.next_power_of_2(N))


def ssd_chunk_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 256,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SSD scan over one sequence or a varlen batch; see ``reference.ssd_chunk_scan``.

    Args:
        x: ``[T, H, P]``; dt: ``[T, H]``; A: ``[H]``; B, C: ``[T, G, N]`` (rows may be strided,
        e.g. views into the conv output); D: ``[H]`` or None.
        initial_state: ``[N_seq, H, P, N]`` fp32 or None; cu_seqlens: ``[N_seq + 1]`` int64 or None.

    Returns:
        ``(y [T, H, P] in x.dtype, final_state [N_seq, H, P, N] fp32)``.
    """
    op = "ssd_chunk_scan"
    check_supported(op, [("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D)])
    _check(x, dt, A, B, C, D)
    T, H, P = x.shape
    G, N = B.shape[1:]
    BP, BN = _blocks(op, P, N)
    S = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    check_state("initial_state", initial_state, (S, H, P, N))
    x, dt, B, C = rows(x), rows(dt), rows(B), rows(C)
    y = torch.empty((T, H, P), dtype=x.dtype, device=x.device)
    ht = torch.empty((S, H, P, N), dtype=torch.float32, device=x.device)
    h0 = None if initial_state is None else initial_state.to(dtype=torch.float32).contiguous()
    if S == 0:
        return y, ht
    ssd_chunk_scan_kernel[(S * H, triton.cdiv(P, BP))](
        x, dt, A.contiguous(), B, C, None if D is None else D.contiguous(), y, h0, ht, cu_or_dummy(cu_seqlens, x), T,
        x.stride(0), x.stride(1), dt.stride(0), B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        H=H, G=G, P=P, N=N, BT=BT_CHUNK, BP=BP, BN=BN,
        HAS_D=D is not None, HAS_H0=h0 is not None, IS_VARLEN=cu_seqlens is not None, num_warps=4,
    )
    return y, ht


def selective_state_update(
    state: torch.Tensor,
    x: torch.Tensor,
    dt: torch.Tensor,
    A: torch.Tensor,
    B: torch.Tensor,
    C: torch.Tensor,
    *,
    D: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence; see ``reference.selective_state_update``. Functional.

    Args:
        state: ``[Bt, H, P, N]`` fp32; x: ``[Bt, H, P]``; dt: ``[Bt, H]``; A: ``[H]``;
        B, C: ``[Bt, G, N]``; D: ``[H]`` or None.

    Returns:
        ``(y [Bt, H, P] in x.dtype, new_state [Bt, H, P, N] fp32)``.
    """
    op = "selective_state_update"
    check_supported(op, [("state", state), ("x", x), ("dt", dt), ("A", A), ("B", B), ("C", C), ("D", D)])
    _check(x, dt, A, B, C, D)
    Bt, H, P = x.shape
    G, N = B.shape[1:]
    BP, BN = _blocks(op, P, N)
    check_state("state", state, (Bt, H, P, N))
    state, x, dt, B, C = rows(state), rows(x), rows(dt), rows(B), rows(C)
    y = torch.empty((Bt, H, P), dtype=x.dtype, device=x.device)
    new_state = torch.empty((Bt, H, P, N), dtype=torch.float32, device=x.device)
    if Bt == 0:
        return y, new_state
    selective_state_update_kernel[(Bt * H, triton.cdiv(P, BP))](
        state, x, dt, A.contiguous(), B, C, None if D is None else D.contiguous(), y, new_state,
        state.stride(0), state.stride(1), state.stride(2), x.stride(0), x.stride(1), dt.stride(0),
        B.stride(0), B.stride(1), C.stride(0), C.stride(1),
        H=H, G=G, P=P, N=N, BP=BP, BN=BN, HAS_D=D is not None, num_warps=4,
    )
    return y, new_state
