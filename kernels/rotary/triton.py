"""Rotary position embedding as a Triton kernel (same contract as ``reference.py``): NeoX or
interleaved pairs, partial rotary, one program per token and block of heads."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerzoo.kernels.triton_common import INTERPRET as _INTERPRET
from layerzoo.kernels.triton_common import check_inputs, round_to

MAX_BLOCK = 8192  # elements of x per program: BH heads of BD features

# The autotuner times configs on a GPU; the interpreter has no timer, so it gets one config.
NUM_WARPS = [1] if _INTERPRET else [1, 2, 4, 8]


@triton.autotune(
    configs=[triton.Config({}, num_warps=w) for w in NUM_WARPS], key=["H", "D", "R", "BH", "INTERLEAVED"]
)
@triton.jit(do_not_specialize=["T"])
def rotary_fwd_kernel(
    x, cos, sin, y,
    T, stride_xt, stride_xh, stride_c, stride_s,
    H: tl.constexpr, D: tl.constexpr, R: tl.constexpr,
    BH: tl.constexpr, BD: tl.constexpr, INTERLEAVED: tl.constexpr,
):
    # int64 token index: T * H * D can pass 2³¹ on long prefills
    i_t, i_h = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_h = i_h * BH + tl.arange(0, BH)
    o_d = tl.arange(0, BD)
    m_h, m_d, m_r = o_h < H, o_d < D, o_d < R
    # feature d is rotated with its partner feature by the angle in column o_c of cos/sin:
    # out[d] = x[d] * cos[o_c] + sign * x[partner] * sin[o_c]
    if INTERLEAVED:
        # pairs (2i, 2i+1) by angle i: only the first R/2 columns of cos/sin are read
        o_pair = o_d ^ 1
        o_c = o_d // 2
        b_sign = tl.where(o_d % 2 == 0, -1.0, 1.0)
    else:
        # pairs (i, i + R/2), cos/sin read per feature
        o_pair = tl.where(o_d < R // 2, o_d + R // 2, o_d - R // 2)
        o_c = o_d
        b_sign = tl.where(o_d < R // 2, -1.0, 1.0)

    # [BD], fp32 from here on (bf16 is storage only)
    b_cos = tl.load(cos + i_t * stride_c + o_c, mask=m_r, other=0.0).to(tl.float32)
    b_sin = tl.load(sin + i_t * stride_s + o_c, mask=m_r, other=0.0).to(tl.float32)
    # [BH, BD]
    p_x = x + i_t * stride_xt + o_h[:, None] * stride_xh
    b_x = tl.load(p_x + o_d[None, :], mask=m_h[:, None] & m_d[None, :], other=0.0).to(tl.float32)
    # [BH, BD]: the partners, rotary part only
    b_xp = tl.load(p_x + o_pair[None, :], mask=m_h[:, None] & m_r[None, :], other=0.0).to(tl.float32)
    b_y = b_x * b_cos[None, :] + (b_sign * b_sin)[None, :] * b_xp
    # [BH, BD]: features past R pass through
    b_y = tl.where(m_r[None, :], b_y, b_x)
    p_y = y + i_t * H * D + o_h[:, None] * D + o_d[None, :]
    tl.store(p_y, round_to(b_y, y.dtype.element_ty), mask=m_h[:, None] & m_d[None, :])


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    def fail(message: str):
        raise ValueError(f"apply_rotary: {message}")

    check_inputs("apply_rotary", [("x", x), ("cos", cos), ("sin", sin)])
    if x.dim() != 3:
        fail(f"x must be [T, H, D], got {tuple(x.shape)}; flatten other leading dims into T")
    T, _, D = x.shape
    if cos.dim() != 2 or cos.shape[0] != T or sin.shape != cos.shape:
        fail(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must both be [T, R] with T = {T}")
    if cos.shape[1] % 2 or cos.shape[1] > D:
        fail(f"rotary dim R = {cos.shape[1]} must be even and at most head dim D = {D}")
    if triton.next_power_of_2(D) > MAX_BLOCK:
        fail(f"head dim D = {D} is too wide for one block (at most {MAX_BLOCK})")


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first ``R`` features of every head; the output is a new tensor.

    Args:
        x: ``[T, H, D]``, float32, float16 or bfloat16; tokens and heads may be strided (a slice of
            a fused qkv projection), features must be contiguous.
        cos, sin: ``[T, R]``, ``R`` even and ``<= D`` (``R < D``: the rest pass through), laid out
            as ``cat(freqs, freqs)`` in both layouts.
        interleaved: False (default) for NeoX / rotate-half pairs ``(x[i], x[i + R/2])``; True for
            GPT-J pairs ``(x[2i], x[2i+1])`` rotated by angle ``i`` (reads columns ``[:R/2]``).

    Returns:
        ``[T, H, D]`` in the promoted dtype of ``x`` and ``cos``, as the reference.

    Examples::
        >>> q = apply_rotary(q, cos, sin)                    # q [T, Hq, D], NeoX
        >>> k = apply_rotary(k, cos, sin, interleaved=True)  # GPT-J layout
    """
    _check(x, cos, sin)
    y = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, cos.dtype), device=x.device)
    if x.numel() == 0:
        return y
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    T, H, D = x.shape
    BD = triton.next_power_of_2(D)
    BH = min(triton.next_power_of_2(H), max(1, MAX_BLOCK // BD))
    rotary_fwd_kernel[(T, triton.cdiv(H, BH))](
        x, cos, sin, y,
        T, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        H=H, D=D, R=cos.shape[1], BH=BH, BD=BD, INTERLEAVED=bool(interleaved),
    )
    return y
