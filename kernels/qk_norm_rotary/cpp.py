"""The C++ CPU backend of ``qk_norm_rotary`` (``qk_norm_rotary_cpu.cpp``): norm and rotation of every
head in one pass, bitwise the separate C++ ops' result. fp32 or bf16, one dtype; anything else,
or a build without the C++ kernels, raises `KernelUnsupported` and the torch reference runs."""

from __future__ import annotations

import torch

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels import cpp_build


def qk_norm_rotary(q, k, q_weight, k_weight, eps, cos, sin):
    """Same contract as `reference.qk_norm_rotary`: ``q [T, Hq, D]``, ``k [T, Hkv, D]`` → both rotated."""
    cpp_build.require()
    weights = () if q_weight is None else (q_weight, k_weight)
    if q.dtype not in cpp_build.DTYPES or any(t.dtype != q.dtype for t in (k, cos, sin, *weights)):
        raise KernelUnsupported(f"C++ qk_norm_rotary takes fp32 or bf16, one dtype (q {q.dtype}, cos {cos.dtype})")
    if q.stride(-1) != 1 or k.stride(-1) != 1:  # any token and head stride, not a strided head
        q, k = q.contiguous(), k.contiguous()
    return torch.ops.layerzoo_cpu.qk_norm_rotary.default(q, k, q_weight, k_weight, float(eps), cos.contiguous(), sin.contiguous())
