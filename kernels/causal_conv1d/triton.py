"""Depthwise causal conv1d in Triton: the same ops, signatures and math as ``reference.py``.

Two kernels: ``causal_conv1d_fwd_kernel`` (one program per block of ``BT`` tokens × ``BD``
channels; a token's taps before its sequence start are read from the conv state) and
``conv_state_kernel`` (one program per sequence × ``BD`` channels: the last ``W - 1`` raw inputs).
Tokens find their sequence through a ``seq_idx [T]`` built on the device (no host sync).
`causal_conv1d_update` is the same pair of kernels with one-token sequences.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels.triton_common import INTERPRET, round_to
from layerzoo.kernels.triton_varlen import check_supported, rows
from layerzoo.kernels.varlen import check_state


@triton.jit
def causal_conv1d_fwd_kernel(
    x, weight, bias, conv_state, y, cu_seqlens, seq_idx, T, D,
    stride_x, stride_wd, stride_sn, stride_sd, stride_sw,
    W: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_STATE: tl.constexpr, IS_VARLEN: tl.constexpr, SILU: tl.constexpr,
):
    i_t, i_d = tl.program_id(0), tl.program_id(1)
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_d = i_d * BD + tl.arange(0, BD)
    m_t, m_d = o_t < T, o_d < D
    # [BT]: each token's sequence and where it starts
    if IS_VARLEN:
        b_seq = tl.load(seq_idx + o_t, mask=m_t, other=0).to(tl.int64)
        b_bos = tl.load(cu_seqlens + b_seq, mask=m_t, other=0).to(tl.int64)
    else:
        b_seq = tl.zeros([BT], dtype=tl.int64)
        b_bos = tl.zeros([BT], dtype=tl.int64)

    b_y = tl.zeros([BT, BD], dtype=tl.float32)
    if HAS_BIAS:
        b_y += tl.load(bias + o_d, mask=m_d, other=0.0).to(tl.float32)[None, :]
    for w in tl.static_range(W):
        # tap w reads position p = t - (W-1) + w: from x inside the sequence, else from the state
        b_p = o_t - (W - 1) + w
        m_x = (b_p >= b_bos) & m_t
        b_x = tl.load(x + b_p[:, None] * stride_x + o_d[None, :], mask=m_x[:, None] & m_d[None, :], other=0.0)
        b_x = b_x.to(tl.float32)
        if HAS_STATE:
            m_s = (b_p < b_bos) & m_t
            b_j = b_p - b_bos + (W - 1)  # column of the state, oldest first
            p_s = conv_state + b_seq[:, None] * stride_sn + o_d[None, :] * stride_sd + b_j[:, None] * stride_sw
            b_x += tl.load(p_s, mask=m_s[:, None] & m_d[None, :], other=0.0).to(tl.float32)
        b_w = tl.load(weight + o_d * stride_wd + w, mask=m_d, other=0.0).to(tl.float32)
        b_y += b_x * b_w[None, :]
    if SILU:
        b_y = b_y * tl.sigmoid(b_y)
    p_y = y + o_t[:, None] * D + o_d[None, :]
    tl.store(p_y, round_to(b_y, y.dtype.element_ty), mask=m_t[:, None] & m_d[None, :])


@triton.jit
def conv_state_kernel(
    x, conv_state, new_state, cu_seqlens, T, D,
    stride_x, stride_sn, stride_sd, stride_sw,
    W: tl.constexpr, BW: tl.constexpr, BD: tl.constexpr, HAS_STATE: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    i_n, i_d = tl.program_id(0), tl.program_id(1)
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos = (i_n * 0).to(tl.int64)
        eos = bos + T
    o_j = tl.arange(0, BW)
    o_d = i_d * BD + tl.arange(0, BD)
    m_j, m_d = o_j < W - 1, o_d < D
    # [BW]: column j of the new state is the raw input at p = eos - (W-1) + j
    b_p = eos - (W - 1) + o_j
    m_x = (b_p >= bos) & m_j
    b_x = tl.load(x + b_p[:, None] * stride_x + o_d[None, :], mask=m_x[:, None] & m_d[None, :], other=0.0)
    b_x = b_x.to(tl.float32)
    if HAS_STATE:
        # before the sequence start: the old state's column j + len
        m_s = (b_p < bos) & m_j
        p_s = conv_state + i_n * stride_sn + o_d[None, :] * stride_sd + (o_j + eos - bos)[:, None] * stride_sw
        b_x += tl.load(p_s, mask=m_s[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    p_new = new_state + (i_n * D + o_d[None, :]).to(tl.int64) * (W - 1) + o_j[:, None]
    tl.store(p_new, round_to(b_x, new_state.dtype.element_ty), mask=m_j[:, None] & m_d[None, :])


def _conv(x, weight, bias, conv_state, cu_seqlens, seq_idx, N, activation, op):
    check_supported(op, [("x", x), ("weight", weight), ("bias", bias), ("conv_state", conv_state)])
    if activation not in ("silu", "swish", None):
        raise ValueError(f"{op}: activation must be 'silu' or None, got {activation!r}")
    T, D = x.shape
    W = weight.shape[-1]
    if weight.shape != (D, W) or (bias is not None and bias.shape != (D,)):
        raise ValueError(f"{op}: weight must be [D, W] and bias [D] for x {list(x.shape)}, got "
                         f"{list(weight.shape)} and {None if bias is None else list(bias.shape)}")
    if W < 2:
        raise KernelUnsupported(f"{op} in triton needs a kernel width of at least 2, got {W}")
    check_state("conv_state", conv_state, (N, D, W - 1))
    x, weight = rows(x), rows(weight)
    y = torch.empty((T, D), dtype=x.dtype, device=x.device)
    state_dtype = x.dtype if conv_state is None else conv_state.dtype
    new_state = torch.empty((N, D, W - 1), dtype=state_dtype, device=x.device)
    if N == 0:
        return y, new_state
    s_strides = (0, 0, 0) if conv_state is None else conv_state.stride()
    BD = min(triton.next_power_of_2(D), 128 if INTERPRET else 64)
    BT = 32 if INTERPRET else 16
    varlen = cu_seqlens is not None
    if T > 0:
        causal_conv1d_fwd_kernel[(triton.cdiv(T, BT), triton.cdiv(D, BD))](
            x, weight, bias, conv_state, y, cu_seqlens, seq_idx, T, D,
            x.stride(0), weight.stride(0), *s_strides,
            W=W, BT=BT, BD=BD, HAS_BIAS=bias is not None, HAS_STATE=conv_state is not None,
            IS_VARLEN=varlen, SILU=activation is not None, num_warps=4,
        )
    conv_state_kernel[(N, triton.cdiv(D, BD))](
        x, conv_state, new_state, cu_seqlens, T, D, x.stride(0), *s_strides,
        W=W, BW=triton.next_power_of_2(W - 1), BD=BD, HAS_STATE=conv_state is not None, IS_VARLEN=varlen,
        num_warps=4,
    )
    return y, new_state


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal conv over one sequence or a varlen batch; see ``reference.causal_conv1d``.

    Args:
        x: ``[T, D]`` (rows may be strided); weight: ``[D, W]``; bias: ``[D]`` or None.
        conv_state: ``[N, D, W-1]`` or None; cu_seqlens: ``[N + 1]`` int64 or None.

    Returns:
        ``(y [T, D] in x.dtype, final_conv_state [N, D, W-1])`` (state dtype: ``conv_state``'s, else ``x``'s).
    """
    T = x.shape[0]
    if cu_seqlens is None:
        return _conv(x, weight, bias, conv_state, None, None, 1, activation, "causal_conv1d")
    cu = cu_seqlens.to(device=x.device, dtype=torch.int64)
    N = cu.shape[0] - 1
    seq_idx = torch.repeat_interleave(torch.arange(N, device=x.device), cu[1:] - cu[:-1], output_size=T)
    return _conv(x, weight, bias, conv_state, cu, seq_idx, N, activation, "causal_conv1d")


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per sequence; see ``reference.causal_conv1d_update``. Functional.

    Args:
        x: ``[B, D]``; conv_state: ``[B, D, W-1]``; weight: ``[D, W]``; bias: ``[D]`` or None.

    Returns:
        ``(y [B, D] in x.dtype, new_conv_state [B, D, W-1] in conv_state.dtype)``.
    """
    B = x.shape[0]
    seq_idx = torch.arange(B, device=x.device)
    cu = torch.arange(B + 1, device=x.device)
    return _conv(x, weight, bias, conv_state, cu, seq_idx, B, activation, "causal_conv1d_update")
