"""The C++ CPU kernels of MXFP4 weights (``mxfp4_cpu.cpp``, built with the others by
`layerzoo.kernels.cpp_build`) and the CPU expert matmul over them (the op's ``cpp`` backend).

An expert with few rows (decode: up to `GEMV_ROWS`) multiplies its codes in registers (one C++
call for all such experts); an expert with more rows (prefill) is dequantized into a shared fp32
scratch matrix and multiplied by torch's GEMM, one expert at a time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from layerzoo import settings
from layerzoo.errors import KernelUnsupported
from layerzoo.kernels import cpp_build
from layerzoo.kernels.mxfp4_matmul.reference import check_layout

# Up to this many rows an expert runs the C++ GEMV (tiles of 4 rows read its codes once each);
# from here on dequantize + GEMM. Measured crossover (N 1024, K 512, one thread): about 40 rows.
GEMV_ROWS = settings.integer("LAYERZOO_MXFP4_GEMV_ROWS")


def available() -> bool:
    return cpp_build.available() and hasattr(torch.ops.layerzoo_cpu, "mxfp4_gemv")


def gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, experts: torch.Tensor | None = None) -> torch.Tensor:
    """``x [M, K]`` fp32 → ``[M, N]`` fp32: each row times ``W[experts[m]]`` (``packed [E, N, K/2]``), or
    times the one weight ``packed [N, K/2]`` when ``experts`` is None."""
    return torch.ops.layerzoo_cpu.mxfp4_gemv(x, packed, scale, experts)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 weight ``[..., N, K]`` (into ``out`` when given: any contiguous fp32 buffer of that many elements)."""
    shape = (*packed.shape[:-1], packed.shape[-1] * 2)
    out = torch.empty(shape, dtype=torch.float32) if out is None else out
    torch.ops.layerzoo_cpu.mxfp4_dequantize(packed, scale, out)
    return out.view(shape)


_scratch: torch.Tensor | None = None


def _scratch_of(numel: int) -> torch.Tensor:
    """A shared fp32 buffer for one expert's dequantized weight (the experts run one after another)."""
    global _scratch
    if _scratch is None or _scratch.numel() < numel:
        _scratch = torch.empty(numel, dtype=torch.float32)
    return _scratch[:numel]


def expert_matmul(x: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`reference.expert_matmul` on CPU: ``x [R, K]``, ``experts [R]``, ``packed [E, N, K/2]``,
    ``scale [E, N, K/32]`` → ``[R, N]`` fp32."""
    if not available():
        raise KernelUnsupported(f"C++ MXFP4 kernels not built: {cpp_build.why_unavailable() or 'no mxfp4_gemv op'}")
    check_layout(packed, scale)
    if x.device.type != "cpu" or packed.dim() != 3:
        raise KernelUnsupported(f"the C++ MXFP4 expert matmul takes CPU tensors and stacked [E, N, K/2] codes, got {x.device.type} {tuple(packed.shape)}")
    xf = x.float().contiguous()
    experts = experts.long().contiguous()
    num_experts, n, half = packed.shape
    packed, scale = packed.contiguous(), scale.contiguous()
    counts = torch.bincount(experts, minlength=num_experts)
    many = (counts > GEMV_ROWS).nonzero(as_tuple=True)[0].tolist()
    if not many:  # decode: every expert's rows in one call
        return gemv(xf, packed, scale, experts)
    y = torch.empty(x.shape[0], n, dtype=torch.float32)
    few = (counts[experts] <= GEMV_ROWS).nonzero(as_tuple=True)[0]
    if few.numel():
        y[few] = gemv(xf.index_select(0, few), packed, scale, experts.index_select(0, few))
    for expert in many:
        rows = (experts == expert).nonzero(as_tuple=True)[0]
        w = dequantize(packed[expert], scale[expert], _scratch_of(n * half * 2))
        y[rows] = F.linear(xf.index_select(0, rows), w)
    return y
