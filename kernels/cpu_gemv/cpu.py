"""The C++ backend of ``cpu_gemv`` (built by `layerzoo.kernels.cpp_build`): few-row products (decode).

``packed_fp32_gemv`` (``packed_fp32.cpp``) multiplies by an fp32 weight ``[N, K]`` read from
oneDNN's packed copy (AVX-512 only), for up to 32 rows; ``packed_bf16_gemv`` (``packed_bf16.cpp``)
likewise by a bf16 weight, ``x`` and ``y`` bf16 (AVX-512 BF16 only; oneDNN's blocks hold 64
outputs, or 32 where the CPU has AMX). (``quantization="int8"`` runs as Q8_0 blocks through
`layerzoo.kernels.gguf_matmul`.)
"""

from __future__ import annotations

import torch

from layerzoo.kernels import cpp_build


def available() -> bool:
    """Whether the kernel is built (builds it on the first call; `cpp_build` registers its shapes
    for ``torch.compile``)."""
    return cpp_build.available()


def packed_fp32_gemv(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ w.T + bias`` → ``[M, N]`` fp32, ``w`` read from ``packed``, the oneDNN-packed
    (``mkldnn._reorder_linear_weight``) fp32 weight ``[N, K]`` in its AVX-512 layout."""
    n, k = packed.shape
    return torch.ops.layerzoo_cpu.packed_fp32_gemv(x.contiguous(), torch.ops.mkldnn.data_ptr(packed), n, k, bias,
                                                   torch.ops.mkldnn._nbytes(packed))


def packed_bf16_gemv(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, block: int = 64) -> torch.Tensor:
    """``x [M, K] @ w.T + bias`` → ``[M, N]`` bf16 (fp32 sums, rounded once), ``w`` read from
    ``packed``, the oneDNN-packed bf16 weight ``[N, K]`` in its AVX-512 BF16 layout with ``block``
    outputs per block (AB16b64a2b; AB16b32a2b where the CPU has AMX, see `bf16_packed_block`)."""
    n, k = packed.shape
    return torch.ops.layerzoo_cpu.packed_bf16_gemv(x.contiguous(), torch.ops.mkldnn.data_ptr(packed), n, k, bias,
                                                   torch.ops.mkldnn._nbytes(packed), block)


def bf16_packed_block() -> int | None:
    """The outputs per block of oneDNN's packed bf16 layout on this CPU, as `packed_bf16_gemv` reads
    it: 64 (AB16b64a2b, AVX-512 BF16) or 32 (AB16b32a2b, with AMX); None where oneDNN does not pack
    bf16 or packs it otherwise. Found by packing ``w[n, 0] = n + 1`` and reading column 0 back."""
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported() or not available():
        return None
    w = torch.zeros(64, 32, dtype=torch.bfloat16)
    w[:, 0] = torch.arange(1, 65)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    x = torch.zeros(1, 32, dtype=torch.bfloat16)
    x[0, 0] = 1
    for block in (64, 32):
        try:
            if torch.equal(packed_bf16_gemv(x, packed, None, block)[0], w[:, 0]):
                return block
        except RuntimeError:  # another size, or built without AVX-512 BF16
            continue
    return None
