"""RMSNorm as a module over the registered ``rms_norm`` op."""

from __future__ import annotations

import torch
from torch import nn

from layerzoo.plugins.ops import kernel


class RMSNorm(nn.Module):
    """``w * x / rms(x)`` over the last dimension; ``forward(x, residual)`` fuses the residual add."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self._op = kernel("rms_norm")

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """``x [..., D]`` → ``y``; with ``residual``, returns ``(y, x + residual)``."""
        y, summed = self._op(x, self.weight, self.eps, residual)
        return y if residual is None else (y, summed)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}"
