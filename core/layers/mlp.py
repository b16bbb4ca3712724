"""The gated (SwiGLU) MLP of most decoder layers."""

from __future__ import annotations

import torch
from torch import nn

from layerzoo.distributed import parallel_state
from layerzoo.errors import ConfigError
from layerzoo.layers.linear import fuse_linears
from layerzoo.layers.parallel_linear import column_parallel_linear, row_parallel_linear, split_rows
from layerzoo.plugins.ops import kernel


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))``; ``x [T, H]`` → ``[T, H]``.

    Tensor parallel: gate/up are column-parallel and down row-parallel over the intermediate
    features; the output is all-reduced unless ``reduce_output`` is False (an owner that adds it to
    other partial sums, e.g. an MoE's shared expert, reduces once for all of them).
    """

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", *, reduce_output: bool = True):
        super().__init__()
        if hidden_act != "silu":
            raise ConfigError(f"config.json: hidden_act {hidden_act!r} is not supported (expected 'silu')")
        inner = split_rows(intermediate_size, "the MLP's intermediate_size")
        self.gate_proj = column_parallel_linear(hidden_size, intermediate_size, shard=inner)
        self.up_proj = column_parallel_linear(hidden_size, intermediate_size, shard=inner)
        self.down_proj = row_parallel_linear(intermediate_size, hidden_size, shard=inner)
        self.reduce_output = reduce_output
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
        out = self.down_proj(self._act(gate, up))
        return parallel_state.all_reduce(out) if self.reduce_output else out
