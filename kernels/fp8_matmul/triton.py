"""The FP8 linear as a Triton GEMM that converts its weight tiles in the kernel (CUDA; tested under
``TRITON_INTERPRET=1`` against ``reference.py``).

The weight is read as its bytes (any GPU, no native FP8 type needed): e4m3 ``s eeee mmm`` is
``(8 + m) * 2^(e - 10)`` for ``e > 0`` (built as fp32 bits: exponent ``e + 120``, mantissa ``m``)
and ``m * 2^-9`` for ``e = 0``, negated when ``s``; each weight times its row's scale of group
``k // group`` (the last group may be short). fp32 activations multiply in full fp32
(``input_precision="ieee"``); bf16/fp16 ones multiply the scaled tile rounded to their dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _e4m3_to_f32(b):
    b = b.to(tl.int32)
    mag = b & 0x7F
    normal = ((mag << 20) + (120 << 23)).to(tl.float32, bitcast=True)
    sub = (mag & 7).to(tl.float32) * 0.001953125
    v = tl.where((mag >> 3) == 0, sub, normal)
    return tl.where((b & 0x80) != 0, -v, v)


@triton.jit
def _fp8_matmul_kernel(x_ptr, w_ptr, s_ptr, bias_ptr, y_ptr, M, N, K, G, stride_xm, stride_ym,
                       GROUP: tl.constexpr, TILE_GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = rm < M
    n_ok = rn < N
    rn64 = rn.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wb = tl.load(w_ptr + rn64[:, None] * K + rk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0)
        if TILE_GROUP:  # the slice lies in one group: one scale per row
            s = tl.load(s_ptr + rn64 * G + k0 // GROUP, mask=n_ok, other=0.0)
            w = _e4m3_to_f32(wb) * s[:, None]  # [BLOCK_N, BLOCK_K]
        else:
            s = tl.load(s_ptr + rn64[:, None] * G + (rk // GROUP)[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            w = _e4m3_to_f32(wb) * s
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def default_blocks(m: int, fp32: bool) -> tuple[tuple[int, int, int], int]:
    """``((BLOCK_M, BLOCK_N, BLOCK_K), num_warps)``: the fastest of a sweep on an H200 (N = K = 4096,
    [128, 128] blocks; M = 1 bf16: 34 us, fp32: 153 us; M = 512 bf16: 98 us; cuBLAS bf16 dense 22-32 us)."""
    if m <= 16:
        return ((16, 32, 64), 2) if fp32 else ((16, 32, 128), 4)
    return ((64, 64, 64), 4) if fp32 else ((128, 64, 64), 8)


def matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, group: int, bias: torch.Tensor | None = None, *,
           blocks: tuple[int, int, int] | None = None, num_warps: int = 4) -> torch.Tensor:
    """``x [M, K] -> [M, N]`` in fp32 (reference.matmul's result); ``w`` e4m3 (or its uint8 view)
    ``[N, K]``, ``scale`` fp32 ``[N, ceil(K/group)]``."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    x = x.contiguous()
    m, k = x.shape
    n = w.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0:
        return y
    if blocks is None:
        blocks, num_warps = default_blocks(m, x.dtype == torch.float32)
    block_m, block_n, block_k = blocks
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _fp8_matmul_kernel[grid](x, w.contiguous().view(torch.uint8), scale.contiguous(), bias if bias is not None else y, y,
                             m, n, k, scale.shape[1], x.stride(0), y.stride(0), GROUP=group,
                             TILE_GROUP=group % block_k == 0 and k % block_k == 0, HAS_BIAS=bias is not None,
                             IEEE=x.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                             num_warps=num_warps)
    return y
