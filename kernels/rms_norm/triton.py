"""RMSNorm with an optional fused residual add, as a Triton kernel (same contract as ``reference.py``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerzoo.kernels.triton_common import INTERPRET as _INTERPRET
from layerzoo.kernels.triton_common import check_inputs, round_to

MAX_BD = 65536  # one row lives in one block; wider rows would need a looped reduction

# The autotuner times configs on a GPU; the interpreter has no timer, so it gets one config
# (several rows per program: the interpreter pays per program, not per element).
if _INTERPRET:
    _CONFIGS = [triton.Config({"BT": 8}, num_warps=1)]
else:
    _CONFIGS = [triton.Config({"BT": bt}, num_warps=w) for bt in (1, 2, 4, 8) for w in (1, 2, 4, 8)]


def _prune(configs, named_args, **kwargs):
    """Several rows per program only while the block stays small (wide rows take one each)."""
    BD = {**named_args, **kwargs}["BD"]
    fit = [c for c in configs if c.kwargs["BT"] * BD <= 16384]
    return fit or [c for c in configs if c.kwargs["BT"] == 1]


@triton.heuristics({"HAS_RESIDUAL": lambda args: args["residual"] is not None})
@triton.autotune(configs=_CONFIGS, key=["D", "HAS_RESIDUAL"], prune_configs_by={"early_config_prune": _prune})
@triton.jit(do_not_specialize=["T"])
def rms_norm_fwd_kernel(
    x, weight, residual, y, residual_out,
    eps, T, stride_x, stride_r,
    D: tl.constexpr, BD: tl.constexpr, BT: tl.constexpr, HAS_RESIDUAL: tl.constexpr,
):
    i_t = tl.program_id(0)
    # int64 row offsets: T * D can pass 2³¹ on long prefills
    o_t = (i_t * BT + tl.arange(0, BT)).to(tl.int64)
    o_d = tl.arange(0, BD)
    m_t, m_d = o_t < T, o_d < D
    m_td = m_t[:, None] & m_d[None, :]

    # [BT, BD], fp32 from here on (bf16 is storage only)
    p_x = x + o_t[:, None] * stride_x + o_d[None, :]
    b_x = tl.load(p_x, mask=m_td, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        # [BT, BD]: the sum is rounded to its storage dtype first, as `x + residual` in torch
        p_r = residual + o_t[:, None] * stride_r + o_d[None, :]
        b_r = tl.load(p_r, mask=m_td, other=0.0).to(tl.float32)
        b_s = round_to(b_x + b_r, residual_out.dtype.element_ty)
        tl.store(residual_out + o_t[:, None] * D + o_d[None, :], b_s, mask=m_td)
        b_x = b_s.to(tl.float32)

    # [BT]
    b_rstd = tl.rsqrt(tl.sum(b_x * b_x, axis=1) / D + eps)
    # [BT, BD]: cast back to the input dtype before the weight multiply (the HF order)
    b_xhat = b_x * b_rstd[:, None]
    if HAS_RESIDUAL:
        b_xhat = round_to(b_xhat, residual_out.dtype.element_ty).to(tl.float32)
    else:
        b_xhat = round_to(b_xhat, x.dtype.element_ty).to(tl.float32)
    # [BD]
    b_w = tl.load(weight + o_d, mask=m_d, other=0.0).to(tl.float32)
    b_y = b_xhat * b_w[None, :]
    tl.store(y + o_t[:, None] * D + o_d[None, :], round_to(b_y, y.dtype.element_ty), mask=m_td)


def _check(x: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor | None) -> None:
    def fail(message: str):
        raise ValueError(f"rms_norm: {message}")

    check_inputs("rms_norm", [("x", x), ("weight", weight)] + ([("residual", residual)] if residual is not None else []))
    if x.dim() < 1 or weight.shape != x.shape[-1:]:
        fail(f"weight {tuple(weight.shape)} must be [D] with D = x.shape[-1] (x is {tuple(x.shape)})")
    if residual is not None and residual.shape != x.shape:
        fail(f"residual {tuple(residual.shape)} must have the shape of x {tuple(x.shape)}")
    if triton.next_power_of_2(x.shape[-1]) > MAX_BD:
        fail(f"D = {x.shape[-1]} is too wide for one block (at most {MAX_BD})")


def _rows(t: torch.Tensor) -> torch.Tensor:
    """``[..., D]`` → ``[T, D]`` with unit feature stride (a view when possible)."""
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = w * x̂`` with ``x̂ = x / sqrt(mean(x²) + eps)`` computed in fp32.

    Args:
        x: ``[..., D]``, float32, float16 or bfloat16 (any leading shape; rows may be strided).
        weight: ``[D]``.
        eps: added to the mean square.
        residual: ``[..., D]`` or None (default); when given, ``x + residual`` is normalised.

    Returns:
        ``(y [..., D], residual_out [..., D])``: ``residual_out`` is the summed input, or ``x``
        itself when ``residual`` is None. Dtypes follow torch promotion, as in the reference.

    Examples::
        >>> y, _ = rms_norm(x, w, 1e-6)                      # x [T, D]
        >>> y, residual = rms_norm(x, w, 1e-6, residual)     # fused add; residual feeds the next block
    """
    _check(x, weight, residual)
    x_dtype = x.dtype if residual is None else torch.promote_types(x.dtype, residual.dtype)
    y = torch.empty(x.shape, dtype=torch.promote_types(weight.dtype, x_dtype), device=x.device)
    residual_out = x if residual is None else torch.empty(x.shape, dtype=x_dtype, device=x.device)
    if x.numel() == 0:
        return y, residual_out

    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else None
    T, D = x2.shape
    grid = lambda meta: (triton.cdiv(T, meta["BT"]),)  # noqa: E731
    rms_norm_fwd_kernel[grid](
        x2, weight.contiguous(), r2, y, None if residual is None else residual_out,
        float(eps), T, x2.stride(0), 0 if r2 is None else r2.stride(0),
        D=D, BD=triton.next_power_of_2(D),
    )
    return y, residual_out
