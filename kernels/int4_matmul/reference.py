"""Weight-only 4-bit linear in plain torch (fp32): the layout's definition and the CPU fallback.

Layout (see README.md): ``q [N, K/2]`` uint8, each run of 32 weights of a row in 16 bytes, byte
``i`` holding weight ``i`` in its low nibble and weight ``i + 16`` in its high nibble; ``scale``
and ``zs`` fp32 ``[N, K/group]``. Weight ``w[n, k] = q[n, k] * scale[n, g] - zs[n, g]`` with
``g = k // group`` (``zs = zero * scale``; symmetric formats have ``zero = 8``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BLOCK = 32  # weights per 16-byte run


def pack(values: torch.Tensor) -> torch.Tensor:
    """``values [N, K]`` integers in 0..15 → ``q [N, K/2]`` uint8 in the layout above."""
    n, k = values.shape
    assert k % BLOCK == 0, f"K={k} is not a multiple of {BLOCK}"
    v = values.to(torch.uint8).reshape(n, k // BLOCK, 2, BLOCK // 2)
    return (v[:, :, 0] | (v[:, :, 1] << 4)).reshape(n, k // 2).contiguous()


def unpack(q: torch.Tensor) -> torch.Tensor:
    """``q [N, K/2]`` uint8 → ``[N, K]`` uint8 values in 0..15."""
    n, half = q.shape
    b = q.reshape(n, half // (BLOCK // 2), BLOCK // 2)
    return torch.stack((b & 0xF, b >> 4), dim=2).reshape(n, half * 2)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zs: torch.Tensor, group: int) -> torch.Tensor:
    """The fp32 weight ``[N, K]``: ``q * scale - zs`` per group."""
    values = unpack(q).float()
    s = scale.float().repeat_interleave(group, dim=1)
    z = zs.float().repeat_interleave(group, dim=1)
    return values * s - z


def matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zs: torch.Tensor, group: int,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K] -> [M, N]`` fp32: ``x @ dequantize(...).T + bias``."""
    return F.linear(x.float(), dequantize(q, scale, zs, group), None if bias is None else bias.float())
