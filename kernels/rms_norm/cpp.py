"""The C++ CPU backend of ``rms_norm`` (``rms_norm_cpu.cpp``): one pass per row, the residual add
fused, one dispatch instead of torch's six. fp32 only; anything else, or a build without the C++
kernels, raises `KernelUnsupported` and the torch reference runs."""

from __future__ import annotations

import torch

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels import cpp_build


def rms_norm(x, weight, eps, residual=None):
    """Same contract as `reference.rms_norm`: ``x [..., D]`` → ``(y, x + residual or x)``."""
    cpp_build.require()
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or (residual is not None and residual.dtype != torch.float32):
        raise KernelUnsupported(f"C++ rms_norm is fp32 only (x {x.dtype}, weight {weight.dtype})")
    shape = x.shape
    rows = x.reshape(-1, shape[-1]).contiguous()
    if residual is None:
        return torch.ops.layerzoo_cpu.rms_norm(rows, weight.contiguous(), float(eps)).view(shape), x
    y, summed = torch.ops.layerzoo_cpu.add_rms_norm(rows, residual.reshape(-1, shape[-1]).contiguous(), weight.contiguous(), float(eps))
    return y.view(shape), summed.view(shape)
