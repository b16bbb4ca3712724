"""The C++ CPU backend of ``argmax_finite`` (``argmax_cpu.cpp``): the argmax and the NaN/inf
screen in one vectorised pass. fp32 logits only (the model computes them in fp32); anything else,
or a build without the C++ kernels, raises `KernelUnsupported` and the torch reference runs."""

from __future__ import annotations

import torch

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels import cpp_build


def argmax_finite(logits):
    """Same contract as `reference.argmax_finite`: ``logits [B, V]`` → ``[B]`` int64."""
    cpp_build.require()
    if logits.dtype != torch.float32 or logits.dim() != 2:
        raise KernelUnsupported(f"C++ argmax_finite takes fp32 logits [B, V] (got {logits.dtype}, {logits.dim()}-D)")
    return torch.ops.layerzoo_cpu.argmax_finite.default(logits.contiguous())
