"""MXFP4 weights in plain torch: the format's definition, and the expert matmul every backend matches.

A logical weight ``W [N, K]`` is ``packed [N, K/2]`` (uint8, two E2M1 codes a byte, column ``2i``
in the LOW nibble, ``2i + 1`` in the high one) and ``scale [N, K/32]`` (uint8, E8M0: the power of
two ``2^(s - 127)`` of 32 consecutive input columns), as compressed-tensors' ``mxfp4-pack-quantized``
stores it::

    W[n, j] = E2M1(code(n, j)) * 2^(scale[n, j // 32] - 127)
    E2M1(c) = (-1)^(c >> 3) * [0, 0.5, 1, 1.5, 2, 3, 4, 6][c & 7]

Every product of an E2M1 value and a power of two is exact in fp32 (and in bf16 inside its
exponent range), so the dequantized weight is exact and the backends differ only in the order
of their sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

GROUP = 32  # input columns per E8M0 scale
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def check_layout(packed: torch.Tensor, scale: torch.Tensor) -> None:
    """Raise ValueError unless ``packed [..., N, K/2]`` and ``scale [..., N, K/32]`` are uint8 of one ``N``."""
    if packed.dtype != torch.uint8 or scale.dtype != torch.uint8:
        raise ValueError(f"MXFP4 codes and scales must be uint8, got {packed.dtype} and {scale.dtype}")
    if packed.shape[:-1] != scale.shape[:-1] or scale.shape[-1] * GROUP != packed.shape[-1] * 2:
        raise ValueError(f"MXFP4 codes [..., N, K/2] and scales [..., N, K/32] disagree: {tuple(packed.shape)} and {tuple(scale.shape)}")


def dequantize(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``packed [..., N, K/2]``, ``scale [..., N, K/32]`` (uint8) → ``W [..., N, K]`` in ``dtype``."""
    check_layout(packed, scale)
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32, device=packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).flatten(-2)  # [..., N, K]
    values = table[codes.long()]
    exponent = scale.float().sub(127.0).exp2().repeat_interleave(GROUP, dim=-1)
    return (values * exponent).to(dtype)


def matmul(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K]`` → ``x @ Wᵀ`` ``[M, N]`` in fp32."""
    return F.linear(x.float(), dequantize(packed, scale))


def expert_matmul(x: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Each row times its own expert's weight: ``y[r] = x[r] @ W[experts[r]]ᵀ``.

    Args:
        x: ``[R, K]`` rows (any float dtype).
        experts: ``[R]`` int64 expert of each row, in ``[0, E)``.
        packed: ``[E, N, K/2]`` uint8 codes; scale: ``[E, N, K/32]`` uint8 exponents.
    Returns:
        ``[R, N]`` fp32; rows of one expert are multiplied together (one dequantized weight each).
    """
    check_layout(packed, scale)
    y = torch.zeros(x.shape[0], packed.shape[1], dtype=torch.float32, device=x.device)
    for expert in experts.unique().tolist():
        rows = (experts == expert).nonzero(as_tuple=True)[0]
        y[rows] = matmul(x.index_select(0, rows), packed[expert], scale[expert])
    return y
