"""The C++ CPU kernels of the 4-bit linear (``int4_cpu.cpp``, built with the others by
`layerzoo.kernels.cpp_build`): the few-row GEMV and the dequantization into a scratch matrix."""

from __future__ import annotations

import torch

from layerzoo.kernels import cpp_build


def available() -> bool:
    return cpp_build.available() and hasattr(torch.ops.layerzoo_cpu, "int4_gemv")


def int4_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zs: torch.Tensor, group: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` fp32 → ``[M, N]`` fp32 (reference.matmul's result, summed per group)."""
    return torch.ops.layerzoo_cpu.int4_gemv(x, q, scale, zs, group, bias)


def dequantize(q: torch.Tensor, scale: torch.Tensor, zs: torch.Tensor, group: int,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 weight ``[N, K]`` (into ``out`` when given: any contiguous fp32 buffer of N*K elements)."""
    n, k = q.shape[0], q.shape[1] * 2
    out = torch.empty(n, k, dtype=torch.float32) if out is None else out
    torch.ops.layerzoo_cpu.int4_dequantize(q, scale, zs, group, out)
    return out.view(n, k)
