"""The C++ CPU backend of ``silu_and_mul`` (``silu_and_mul_cpu.cpp``): one pass, reading the gate
and up halves where the fused projection left them. fp32 or bf16; anything else, or a build without
the C++ kernels, raises `KernelUnsupported` and the torch reference runs."""

from __future__ import annotations

import torch

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels import cpp_build


def silu_and_mul(gate, up):
    """Same contract as `reference.silu_and_mul`: ``gate, up [T, I]`` → ``[T, I]`` (any leading shape)."""
    cpp_build.require()
    if gate.dtype != up.dtype or gate.dtype not in cpp_build.DTYPES:
        raise KernelUnsupported(f"C++ silu_and_mul takes fp32 or bf16, one dtype (gate {gate.dtype}, up {up.dtype})")
    if gate.dim() == 2 and gate.stride(-1) == 1 and up.stride(-1) == 1:  # a step's [T, I] halves, as they are
        return torch.ops.layerzoo_cpu.silu_and_mul.default(gate, up)
    shape = gate.shape
    g, u = gate.reshape(-1, shape[-1]), up.reshape(-1, shape[-1])
    if g.stride(-1) != 1:
        g = g.contiguous()
    if u.stride(-1) != 1:
        u = u.contiguous()
    return torch.ops.layerzoo_cpu.silu_and_mul(g, u).view(shape)
