"""SwiGLU activation as a Triton kernel (same contract as ``reference.py``)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerzoo.kernels.triton_common import INTERPRET as _INTERPRET
from layerzoo.kernels.triton_common import check_inputs, round_to

# The autotuner times configs on a GPU; the interpreter has no timer, so it gets one config
# (a wide block: the interpreter pays per program, not per element).
if _INTERPRET:
    _CONFIGS = [triton.Config({"BI": 1024}, num_warps=1)]
else:
    _CONFIGS = [triton.Config({"BI": bi}, num_warps=w) for bi in (256, 1024, 4096) for w in (2, 4, 8)]


@triton.autotune(configs=_CONFIGS, key=["I"])
@triton.jit(do_not_specialize=["T"])
def silu_and_mul_fwd_kernel(gate, up, out, T, I, stride_g, stride_u, BI: tl.constexpr):
    # int64 row index: T * I can pass 2³¹ on long prefills
    i_t, i_i = tl.program_id(0).to(tl.int64), tl.program_id(1)
    o_i = i_i * BI + tl.arange(0, BI)
    m_i = o_i < I
    # [BI], fp32 from here on (bf16 is storage only)
    b_g = tl.load(gate + i_t * stride_g + o_i, mask=m_i, other=0.0).to(tl.float32)
    b_u = tl.load(up + i_t * stride_u + o_i, mask=m_i, other=0.0).to(tl.float32)
    # silu(g) = g * sigmoid(g); exp overflows to inf for g << 0, giving -0 as it should
    b_o = b_g / (1.0 + tl.exp(-b_g)) * b_u
    tl.store(out + i_t * I + o_i, round_to(b_o, out.dtype.element_ty), mask=m_i)


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    def fail(message: str):
        raise ValueError(f"silu_and_mul: {message}")

    check_inputs("silu_and_mul", [("gate", gate), ("up", up)])
    if gate.dim() < 1 or up.shape != gate.shape:
        fail(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have the same shape [T, I]")


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``, computed in fp32 and rounded once to the output dtype.

    Args:
        gate: ``[T, I]`` (or ``[..., I]``), float32, float16 or bfloat16; rows may be strided (the
            halves of a fused ``gate_up [T, 2I]``), features must be contiguous.
        up: same shape as ``gate``.

    Returns:
        ``[T, I]`` in the promoted dtype of ``gate`` and ``up``, as the reference.

    Examples::
        >>> out = silu_and_mul(gate_up[:, :I], gate_up[:, I:])
    """
    _check(gate, up)

    out = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype), device=gate.device)
    if gate.numel() == 0:
        return out
    g2, u2 = (t.reshape(-1, t.shape[-1]) for t in (gate, up))
    g2, u2 = (t if t.stride(-1) == 1 else t.contiguous() for t in (g2, u2))
    T, I = g2.shape
    grid = lambda meta: (T, triton.cdiv(I, meta["BI"]))  # noqa: E731
    silu_and_mul_fwd_kernel[grid](g2, u2, out, T, I, g2.stride(0), u2.stride(0))
    return out
