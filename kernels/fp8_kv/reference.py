"""FP8 (e4m3) KV-cache quantisation with one per-tensor scale, in plain torch.

``x8 = cast_e4m3(clamp(x / scale, -448, 448))`` and back ``x ≈ x8.float() * scale``. The scale is
a 0-d fp32 tensor on the device (never a Python float), so that a graph captured with it reads the
value the scale holds at replay time.
"""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` (any float dtype, any shape) → ``float8_e4m3fn`` of the same shape.

    Args:
        x: the values; computed in fp32.
        scale: ``[]`` fp32, on ``x``'s device; the value an fp8 unit stands for.
    """
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_fp8(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float8_e4m3fn`` of any shape → ``x8.float() * scale`` cast to ``dtype``."""
    return (x8.float() * scale).to(dtype)
