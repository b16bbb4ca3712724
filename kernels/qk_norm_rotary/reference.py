"""Attention's per-head QK-norm then RoPE, in plain torch: the two ops it fuses, in order."""

from __future__ import annotations

import torch

from layerzoo.kernels.rms_norm.reference import rms_norm
from layerzoo.kernels.rotary.reference import apply_rotary


def qk_norm_rotary(
    q: torch.Tensor,
    k: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """RMS-normalise every head of q and k over ``D`` (skipped when the weights are None), then
    rotate their first ``R`` features (NeoX / rotate-half pairs).

    Args:
        q: ``[T, Hq, D]``; k: ``[T, Hkv, D]`` (views of a fused qkv projection are fine).
        q_weight, k_weight: ``[D]`` each, or both None.
        cos, sin: ``[T, R]``, ``R <= D`` even, as `layerzoo.kernels.rotary.reference.cos_sin` makes them.

    Returns:
        ``(q [T, Hq, D], k [T, Hkv, D])``.
    """
    assert (q_weight is None) == (k_weight is None), "both norm weights or neither"
    if q_weight is not None:
        q, k = rms_norm(q, q_weight, eps)[0], rms_norm(k, k_weight, eps)[0]
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
