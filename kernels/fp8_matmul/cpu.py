"""The C++ CPU kernels of the FP8 linear (``fp8_cpu.cpp``, built with the others by
`layerzoo.kernels.cpp_build`): the few-row GEMV and the dequantization into a scratch matrix."""

from __future__ import annotations

import torch

from layerzoo.kernels import cpp_build


def available() -> bool:
    return cpp_build.available() and hasattr(torch.ops.layerzoo_cpu, "fp8_gemv")


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, group: int,
             bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` fp32 → ``[M, N]`` fp32 (reference.matmul's result, summed per group); ``w`` is
    read as its bytes (float8_e4m3fn or a uint8 view)."""
    return torch.ops.layerzoo_cpu.fp8_gemv(x, w, scale, group, bias)


def dequantize(w: torch.Tensor, scale: torch.Tensor, group: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 weight ``[N, K]`` (into ``out`` when given: any contiguous fp32 buffer of N*K elements)."""
    n, k = w.shape
    out = torch.empty(n, k, dtype=torch.float32) if out is None else out
    torch.ops.layerzoo_cpu.fp8_dequantize(w, scale, group, out)
    return out.view(n, k)
