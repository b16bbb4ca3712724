"""RMSNorm with an optional fused residual add, in plain torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``y = w * x̂`` with ``x̂ = x / sqrt(mean(x²) + eps)`` computed in fp32.

    Args:
        x: ``[..., D]``.
        weight: ``[D]``.
        residual: ``[..., D]`` or None; when given, ``x + residual`` is normalised.

    Returns:
        ``(y [..., D], new_residual [..., D])`` where ``new_residual`` is the (summed) input, the
        stream the next block adds to.
    """
    if residual is not None:
        x = x + residual
    dtype = x.dtype
    if dtype == torch.float32 and weight.dtype == torch.float32:
        # One fused op instead of six (pow, mean, add, rsqrt, mul, mul): the same fp32 math, and on
        # a shared CPU each op of a prefill-sized tensor waits for every OpenMP thread to be scheduled.
        return F.rms_norm(x, (x.shape[-1],), weight, eps), x
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # Cast back before the weight multiply, as the HF reference does: keeps bf16 bit-compatible.
    return weight * xf.to(dtype), x
