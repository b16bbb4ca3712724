"""RMSNorm with an optional fused residual add, in plain torch."""

from __future__ import annotations

import torch


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
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    # Cast back before the weight multiply, as the HF reference does: keeps bf16 bit-compatible.
    return weight * xf.to(dtype), x
