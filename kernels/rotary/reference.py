"""Rotary position embedding (NeoX / rotate-half layout, optional partial rotary), plain torch."""

from __future__ import annotations

import torch


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float, dtype: torch.dtype):
    """``cos, sin [T, rotary_dim]`` for ``positions [T]`` (angles in fp32, as transformers)."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` features of every head.

    Args:
        x: ``[T, H, D]``.
        cos, sin: ``[T, R]`` with ``R <= D`` (``R < D`` is partial rotary: the rest pass through).

    Returns:
        ``[T, H, D]``: ``x_r * cos + rotate_half(x_r) * sin`` on the rotary part.
    """
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-x_rot[..., half:], x_rot[..., :half]), dim=-1)
    out = x_rot * cos[:, None, :] + rotated * sin[:, None, :]
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)
