"""The two RMSNorm variants of the Qwen3-Next family."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from layerzoo.layers.norm import RMSNorm


class ZeroCenteredRMSNorm(RMSNorm):
    """``x̂ * (1 + w)``: the weight is stored as an offset from one (initialised to zero).

    Every norm of Qwen3-Next / Qwen3.5 is of this kind except the gated output norm of the GDN layer.
    """

    # diff with RMSNorm: the scale is 1 + w
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        y, summed = self._op(x, 1.0 + self.weight, self.eps, residual)
        return y if residual is None else (y, summed)


class GatedRMSNorm(nn.Module):
    """``w * x̂ * silu(z)`` over each head's ``D`` features: ``x, z [T, H, D]`` → ``[T, H, D]``.

    The normalised x is cast back to the input dtype before the weight, the gate applies in fp32.
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * xf.to(dtype)
        return (out * F.silu(z.float())).to(dtype)
