"""The gated (SwiGLU) MLP of most decoder layers."""

from __future__ import annotations

import torch
from torch import nn

from layerzoo.errors import ConfigError
from layerzoo.layers.linear import fuse_linears
from layerzoo.ops import kernel


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; ``x [T, H]`` → ``[T, H]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu"):
        super().__init__()
        if hidden_act != "silu":
            raise ConfigError(f"config.json: hidden_act {hidden_act!r} is not supported (expected 'silu')")
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)
        self._act = kernel("silu_and_mul")
        self.gate_up = None  # gate_proj and up_proj as one matmul, after fuse_projections

    def fuse_projections(self) -> None:
        """Replace gate_proj and up_proj by one linear over both (one bigger matmul is faster)."""
        self.gate_up = fuse_linears([self.gate_proj, self.up_proj])
        del self.gate_proj, self.up_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(self._act(gate, up))
