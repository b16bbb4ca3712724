"""Weight-only FP8 (e4m3) linear in plain torch (fp32): the layout's definition and the CPU fallback.

``w [N, K]`` float8_e4m3fn (one byte a weight, as stored) and ``scale [N, K/group]`` fp32: weight
``w[n, k] * scale[n, k // group]``; a per-channel or per-tensor scale is one group of the whole row
(``group = K``), a ``[128, 128]`` block scale is its block's row repeated over the block's rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def expand_scale(scale: torch.Tensor, n: int, k: int, block: tuple[int, int] | None) -> tuple[torch.Tensor, int]:
    """A checkpoint's scale (``[1]``, ``[N, 1]``, or ``[ceil(N/bn), ceil(K/bk)]`` per block) →
    ``(scale [N, G] fp32, group)``."""
    scale = scale.float()
    if block is None:
        if scale.numel() == 1:
            return scale.reshape(1, 1).expand(n, 1).contiguous(), k
        assert scale.numel() == n, f"scale {tuple(scale.shape)} for [{n}, {k}]"
        return scale.reshape(n, 1).contiguous(), k
    bn, bk = block
    assert scale.shape == ((n + bn - 1) // bn, (k + bk - 1) // bk), f"block scale {tuple(scale.shape)} for [{n}, {k}] / {block}"
    return scale.repeat_interleave(bn, dim=0)[:n].contiguous(), bk


def dequantize(w: torch.Tensor, scale: torch.Tensor, group: int) -> torch.Tensor:
    """The fp32 weight ``[N, K]``: ``w * scale`` per group (the last group may be short)."""
    k = w.shape[1]
    return w.float() * scale.float().repeat_interleave(group, dim=1)[:, :k]


def matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, group: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] -> [M, N]`` fp32: ``x @ dequantize(...).T + bias``."""
    return F.linear(x.float(), dequantize(w, scale, group), None if bias is None else bias.float())
