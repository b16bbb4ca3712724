"""Rotary position embedding: the frequencies of a `RopeConfig` (default, linear, llama3 and YaRN
scaling, as transformers computes them), cos/sin per step."""

from __future__ import annotations

import math

import torch
from torch import nn

from layerzoo.config import RopeConfig
from layerzoo.kernels.rotary.reference import cos_sin
from layerzoo.plugins.ops import kernel


def inv_freq_and_scaling(rope: RopeConfig, head_dim: int, max_position_embeddings: int | None = None):
    """``(inv_freq [rotary_dim // 2], attention_scaling)`` of ``rope`` as transformers computes them."""
    dim = int(head_dim * rope.partial_rotary_factor)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    if rope.rope_type == "default":
        return inv_freq, 1.0
    if rope.rope_type == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, rope), 1.0
    return _yarn_inv_freq(rope, dim, max_position_embeddings)


def _llama3_inv_freq(inv_freq, rope: RopeConfig):
    old_len = rope.original_max_position_embeddings
    low_wavelen = old_len / rope.low_freq_factor
    high_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn_inv_freq(rope: RopeConfig, dim: int, max_position_embeddings: int | None):
    original = rope.original_max_position_embeddings or max_position_embeddings
    factor = rope.factor if rope.factor is not None else max_position_embeddings / original

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = float(mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim))
        else:
            attention_factor = mscale(factor)
    beta_fast, beta_slow = rope.beta_fast or 32, rope.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (factor * pos_freqs)
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep, attention_factor


class RotaryEmbedding(nn.Module):
    """Computes ``cos, sin [T, R]`` for a step's positions and rotates q/k with them."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_position_embeddings: int | None = None):
        super().__init__()
        inv_freq, scaling = inv_freq_and_scaling(rope, head_dim, max_position_embeddings)
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
