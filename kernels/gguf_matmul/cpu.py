"""The C++ backend of ``gguf_matmul`` (``gguf_cpu.cpp``, built by `layerzoo.kernels.cpp_build`).

``blocks [N, row_bytes]`` uint8 holds the GGUF blocks of a linear weight ``[N, k]`` as in the
file; ``qtype`` is the ``gguf.GGMLQuantizationType`` value (`SUPPORTED_TYPES`). `dequantize` is
bitwise `reference.dequantize`; `gguf_gemv` computes `reference.gguf_matmul` (activations rounded
to int16 per group, or for Q4_K and Q6_K to int8 per superblock as llama.cpp; integer dots, fp32
sums), for few rows (decode); `gguf_gemm` the same math for many rows (prefill, batched decode),
each weight tile decoded once a call.
"""

from __future__ import annotations

import torch

from layerzoo.kernels import cpp_build
from layerzoo.kernels.gguf_matmul.reference import SUPPORTED_TYPES, row_bytes

__all__ = ["SUPPORTED_TYPES", "available", "dequantize", "gemv_kernel", "gguf_gemm", "gguf_gemv", "row_bytes"]


def available() -> bool:
    """Whether the C++ kernels are built (builds them on the first call)."""
    return cpp_build.available()


def dequantize(blocks: torch.Tensor, qtype: int, k: int, rows: torch.Tensor | None = None) -> torch.Tensor:
    """``blocks [N, row_bytes]`` -> fp32 ``[N, k]``, or only ``rows`` (int64 ``[R]``, any order,
    repeats allowed) -> ``[R, k]``: an embedding's lookup."""
    return torch.ops.layerzoo_cpu.gguf_dequantize(blocks, qtype, k, rows)


def gguf_gemv(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, k]`` fp32 ``@ W.T + bias`` -> ``[M, N]`` fp32, ``W`` read from its GGUF blocks
    (`reference.gguf_matmul`'s math)."""
    return torch.ops.layerzoo_cpu.gguf_gemv(x.contiguous(), blocks, qtype, k, bias)


def gguf_gemm(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int,
              bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, k]`` fp32 ``@ W.T + bias`` -> ``[M, N]`` fp32 as `gguf_gemv` computes it (up to fp32
    summation order), for many rows: each tile of weight rows is decoded once (into int16, or
    bytes for Q4_K / Q6_K) and multiplied with every row (``gguf_gemm_cpu.cpp``)."""
    return torch.ops.layerzoo_cpu.gguf_gemm(x.contiguous(), blocks, qtype, k, bias)


def gemv_kernel(qtype: int) -> str:
    """Which integer kernel `gguf_gemv` runs for weights of ``qtype`` in this build, e.g. Q8_0's
    ``"int16 per 32 by bytes, vpdpbusd zmm (AVX-512 VNNI)"`` where the CPU has AVX-512 VNNI (the
    build's ``-march=native`` picks), else ``"int16, vpmaddwd"`` (or ``vpdpwssd``): the same integers."""
    return torch.ops.layerzoo_cpu.gguf_gemv_kernel(qtype)
