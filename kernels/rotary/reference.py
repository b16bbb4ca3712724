"""Rotary position embedding (NeoX / rotate-half or GPT-J / interleaved layout, optional partial
rotary), plain torch."""

from __future__ import annotations

import torch


def cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, scaling: float, dtype: torch.dtype):
    """``cos, sin [T, rotary_dim]`` for ``positions [T]`` (angles in fp32, as transformers)."""
    freqs = positions[:, None].float() * inv_freq[None, :].float()
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * scaling).to(dtype), (emb.sin() * scaling).to(dtype)


def apply_rotary(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool = False
) -> torch.Tensor:
    """Rotate the first ``rotary_dim`` features of every head.

    Args:
        x: ``[T, H, D]``.
        cos, sin: ``[T, R]`` with ``R <= D`` (``R < D`` is partial rotary: the rest pass through),
            laid out as ``cos_sin`` makes them, ``cat(freqs, freqs)``, in both layouts.
        interleaved: False (default) for NeoX / rotate-half pairs ``(x[i], x[i + R/2])``; True for
            GPT-J pairs ``(x[2i], x[2i+1])``, rotated by angle ``i``: only the first ``R/2``
            columns of ``cos, sin`` are read.

    Returns:
        ``[T, H, D]``: ``x_r * cos + rotate_half(x_r) * sin`` on the rotary part (NeoX), or
        ``(x₀c - x₁s, x₁c + x₀s)`` for every pair (interleaved).
    """
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    half = rot // 2
    if interleaved:
        c, s = cos[:, None, :half], sin[:, None, :half]
        x0, x1 = x_rot[..., 0::2], x_rot[..., 1::2]
        out = torch.stack((x0 * c - x1 * s, x1 * c + x0 * s), dim=-1).flatten(-2)
    else:
        # rotate_half(x) * sin = roll(x, half) * (-sin_lo, sin_hi): three ops on [T, H, R] (roll, mul,
        # addcmul) instead of five (neg, cat, mul, mul, add); the sign flip is on the small [T, R].
        signed_sin = torch.cat((-sin[:, :half], sin[:, half:]), dim=-1)
        out = torch.addcmul(x_rot * cos[:, None, :], torch.roll(x_rot, half, dims=-1), signed_sin[:, None, :])
    return out if x_pass.shape[-1] == 0 else torch.cat((out, x_pass), dim=-1)
