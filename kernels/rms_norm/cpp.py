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
    dtype = x.dtype
    if weight.dtype != dtype or dtype not in cpp_build.DTYPES or (residual is not None and residual.dtype != dtype):
        raise KernelUnsupported(f"C++ rms_norm takes fp32 or bf16, one dtype (x {x.dtype}, weight {weight.dtype})")
    # A decode step calls this ~60 times: no reshapes, the op takes any leading shape.
    rows = x if x.is_contiguous() else x.contiguous()
    if residual is None:
        return torch.ops.layerzoo_cpu.rms_norm.default(rows, weight.contiguous(), float(eps)), x
    return torch.ops.layerzoo_cpu.add_rms_norm.default(rows, residual.contiguous(), weight.contiguous(), float(eps))
