"""The C++ CPU backend of ``rotary_embedding`` (``rotary_cpu.cpp``): one pass over q or k, read in
place from the fused projection, bitwise the reference's result in fp32. fp32 or bf16, NeoX (rotate-half)
layout only; interleaved pairs, other dtypes, or a build without the C++ kernels raise
`KernelUnsupported` and the torch reference runs."""

from __future__ import annotations

import torch

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels import cpp_build


def apply_rotary(x, cos, sin, interleaved: bool = False):
    """Same contract as `reference.apply_rotary`: ``x [T, H, D]`` → ``[T, H, D]``."""
    cpp_build.require()
    if interleaved:
        raise KernelUnsupported("C++ rotary_embedding: rotate-half (NeoX) pairs only, not interleaved")
    if not x.dtype == cos.dtype == sin.dtype or x.dtype not in cpp_build.DTYPES:
        raise KernelUnsupported(f"C++ rotary_embedding takes fp32 or bf16, one dtype (x {x.dtype}, cos {cos.dtype})")
    if x.stride(-1) != 1:  # the kernel reads any token and head stride, not a strided head
        x = x.contiguous()
    return torch.ops.layerzoo_cpu.rotary_embedding(x, cos.contiguous(), sin.contiguous())
