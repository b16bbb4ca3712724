"""Plain-torch reference of ``cpu_gemv``: the products the C++ kernels (`cpu.py`) compute.

`packed_fp32_gemv` is the plain product ``x @ w.T + bias`` by the fp32 weight ``w [N, K]`` that the
kernel reads from oneDNN's packed copy; `packed_bf16_gemv` the same for bf16 ``x``, ``w`` and
``bias``, rounded once to bf16.
"""

from __future__ import annotations

import torch


def packed_fp32_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.double() @ w.double().T
    if bias is not None:
        out = out + bias.double()
    return out.float()


def packed_bf16_gemv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The exact product of the bf16 values (float64), plus the bias, rounded once to bf16."""
    out = x.double() @ w.double().T
    if bias is not None:
        out = out + bias.double()
    return out.to(torch.bfloat16)
