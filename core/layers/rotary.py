"""Rotary position embedding: the frequencies of a `RopeConfig`, cos/sin per step."""

from __future__ import annotations

import torch
from torch import nn

from layerzoo.config import RopeConfig
from layerzoo.kernels.rotary.reference import cos_sin
from layerzoo.ops import kernel


class RotaryEmbedding(nn.Module):
    """Computes ``cos, sin [T, R]`` for a step's positions and rotates q/k with them."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int | None = None):
        super().__init__()
        inv_freq, scaling = rope.inv_freq_and_scaling(head_dim, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.attention_scaling = float(scaling)
        self.rotary_dim = 2 * inv_freq.numel()
        self._rotate = kernel("rotary_embedding")

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """``positions [T]`` → ``(cos, sin)``, each ``[T, R]``."""
        return cos_sin(self.inv_freq, positions, self.attention_scaling, dtype)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """``x [T, H, D]`` rotated on its first ``R`` features."""
        return self._rotate(x, cos, sin)
