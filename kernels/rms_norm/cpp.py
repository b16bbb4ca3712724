"""The C++ CPU backend of ``rms_norm`` (``rms_norm_cpu.cpp``): one pass per row, the residual add
fused, one dispatch instead of torch's six. fp32 or bf16 (x, weight and residual of one dtype); anything else, or a build without the C++
kernels, raises `KernelUnsupported` and the torch reference runs."""

from __future__ import annotations

import torch

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels import cpp_build


def rms_norm(x, weight, eps, residual=None):
    """Same contract as `reference.rms_norm`: ``x [..., D]`` → ``(y, x + residual or x)``."""
    cpp_build.require()
    dtypes = {x.dtype, weight.dtype} | ({residual.dtype} if residual is not None else set())
    if len(dtypes) != 1 or x.dtype not in (torch.float32, torch.bfloat16):
        raise KernelUnsupported(f"C++ rms_norm takes fp32 or bf16, one dtype (x {x.dtype}, weight {weight.dtype})")
    shape = x.shape
    rows = x.reshape(-1, shape[-1]).contiguous()
    if residual is None:
        return torch.ops.layerzoo_cpu.rms_norm(rows, weight.contiguous(), float(eps)).view(shape), x
    y, summed = torch.ops.layerzoo_cpu.add_rms_norm(rows, residual.reshape(-1, shape[-1]).contiguous(), weight.contiguous(), float(eps))
    return y.view(shape), summed.view(shape)
