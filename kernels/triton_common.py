"""What the elementwise Triton kernels share: interpreter detection, bf16 rounding, input checks."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerzoo import settings

INTERPRET = settings.switch("TRITON_INTERPRET")  # as triton.jit read it when the kernels were decorated
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def round_to(b, DTYPE: tl.constexpr):
    """fp32 ``b`` rounded to nearest-even in ``DTYPE``.

    GPUs round fp32 → bf16 to nearest-even, but the interpreter truncates; rounding the bits
    explicitly makes both agree with torch. NaN is kept as is (the carry would corrupt it).
    """
    if DTYPE == tl.bfloat16:
        u = b.to(tl.uint32, bitcast=True)
        u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
        b = tl.where(b != b, b, u.to(tl.float32, bitcast=True))
    return b.to(DTYPE)


def check_inputs(op: str, named: list[tuple[str, torch.Tensor]]) -> None:
    """ValueError (naming ``op`` and the argument) unless every tensor has a float dtype the kernels
    store, they share the first one's device, and that device can run Triton here."""
    first_name, first = named[0]
    for name, t in named:
        if t.dtype not in DTYPES:
            raise ValueError(f"{op}: {name} has dtype {t.dtype}; expected one of float32, float16, bfloat16")
        if t.device != first.device:
            raise ValueError(f"{op}: {name} is on {t.device} but {first_name} is on {first.device}; move them together")
    if first.device.type == "cpu" and not INTERPRET:
        raise ValueError(f"{op}: the triton backend needs GPU tensors (or TRITON_INTERPRET=1); use the torch backend on CPU")
