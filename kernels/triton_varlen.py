"""What the ssm Triton wrappers share: the checks that turn a call away (`KernelUnsupported`, the
op then runs its torch reference) and small jit helpers."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels.triton_common import INTERPRET

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_supported(op: str, named: list[tuple[str, torch.Tensor | None]]) -> None:
    """`KernelUnsupported` unless every given tensor is fp32/fp16/bf16 on a device Triton runs on."""
    for name, t in named:
        if t is None:
            continue
        if t.dtype not in DTYPES:
            raise KernelUnsupported(f"{op} in triton takes fp32/fp16/bf16 tensors, got {name} {t.dtype}")
        if t.device.type != "cuda" and not INTERPRET:
            raise KernelUnsupported(f"{t.device.type} tensors need TRITON_INTERPRET=1 for the triton kernels")


def rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a unit stride along its last dim (a view when it already has one)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def cu_or_dummy(cu_seqlens: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The offsets as int64 on the tensors' device (a placeholder when there is one sequence)."""
    if cu_seqlens is None:
        return torch.zeros(2, dtype=torch.int64, device=like.device)
    return cu_seqlens.to(device=like.device, dtype=torch.int64)


@triton.jit
def dot(a, b):
    """fp32 ``a @ b`` at full precision (tf32 would be the GPU default for fp32 operands)."""
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def sequence_bounds(cu_seqlens, i_n, T, IS_VARLEN: tl.constexpr):
    """``(bos, eos)`` int64: sequence ``i_n``'s rows, from ``cu_seqlens`` in a varlen batch, else
    ``[i_n T, (i_n + 1) T)`` (``N`` sequences of ``T`` rows each)."""
    if IS_VARLEN:
        bos = tl.load(cu_seqlens + i_n).to(tl.int64)
        eos = tl.load(cu_seqlens + i_n + 1).to(tl.int64)
    else:
        bos, eos = (i_n * T).to(tl.int64), (i_n * T + T).to(tl.int64)
    return bos, eos
