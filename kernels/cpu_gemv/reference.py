"""Plain-torch reference of ``cpu_gemv``: the products the C++ kernel (`cpu.py`) computes.

``x [M, K]`` fp32, ``q [N, K]`` int8 with ``scale [N]`` (``w = q * scale[:, None]``), ``bias [N]`` or
None → ``[M, N]`` fp32.

`packed_fp32_gemv` is the plain product ``x @ w.T + bias`` by the fp32 weight ``w [N, K]`` that the
kernel reads from oneDNN's packed copy; `packed_bf16_gemv` the same for bf16 ``x``, ``w`` and
``bias``, rounded once to bf16.

`int8_gemv` quantizes each activation row to int8 with its own scale ``max|x[m]| / 127`` (rounded to
nearest even, as the kernel does in fp32), multiplies exactly, then rescales:
``y[m, n] = (xq[m] . q[n]) * (sx[m] * scale[n]) + bias[n]``.
"""

from __future__ import annotations

import torch


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` fp32 → (``xq [M, K]`` int8 values as fp32, ``sx [M]``), ``x ≈ xq * sx[:, None]``."""
    amax = x.abs().amax(dim=1, keepdim=True)
    positive = amax > 0
    inv = torch.where(positive, torch.tensor(127.0) / torch.where(positive, amax, 1.0), 0.0)
    xq = torch.round(x * inv)
    sx = torch.where(positive, amax / torch.tensor(127.0), 0.0)
    return xq, sx[:, 0]


def int8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    xq, sx = quantize_rows(x.float())
    dots = xq.double() @ q.double().T  # exact: integers well inside float64's 53 bits
    out = dots.float() * (sx[:, None] * scale[None, :])
    if bias is not None:
        out = out + bias.float()
    return out


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
