"""SwiGLU activation, plain torch."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up``; ``gate, up [T, I]`` → ``[T, I]``."""
    return F.silu(gate).mul_(up)  # in place on silu's fresh output: one tensor fewer
