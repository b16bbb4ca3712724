"""The 4-bit linear as a Triton GEMM that dequantizes its weight tiles in the kernel (CUDA; tested
under ``TRITON_INTERPRET=1`` against ``reference.py``).

Each program computes a ``[BLOCK_M, BLOCK_N]`` tile of ``y``: per ``BLOCK_K`` slice of the inputs
(inside one group: ``BLOCK_K`` divides the group) it loads the packed bytes of its weight rows,
takes each weight's nibble (weight ``k`` of a row: byte ``k // 32 * 16 + k % 16``, high nibble when
``k % 32 >= 16``), applies the group's ``scale`` and ``zs`` and multiplies. fp32 activations
multiply in full fp32 (``input_precision="ieee"``, no TF32); bf16/fp16 ones multiply the weight
tile rounded to their dtype on the tensor cores.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_matmul_kernel(x_ptr, q_ptr, s_ptr, zs_ptr, bias_ptr, y_ptr, M, N, K, G, stride_xm, stride_ym,
                        GROUP: tl.constexpr, HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
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
        x = tl.load(x_ptr + rm.to(tl.int64)[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None], other=0.0)
        byte = (rk // 32) * 16 + (rk % 16)
        shift = ((rk % 32) // 16) * 4
        qb = tl.load(q_ptr + rn64[:, None] * (K // 2) + byte[None, :], mask=n_ok[:, None], other=0).to(tl.int32)
        qv = ((qb >> shift[None, :]) & 0xF).to(tl.float32)
        g = k0 // GROUP
        s = tl.load(s_ptr + rn64 * G + g, mask=n_ok, other=0.0)
        z = tl.load(zs_ptr + rn64 * G + g, mask=n_ok, other=0.0)
        w = qv * s[:, None] - z[:, None]  # [BLOCK_N, BLOCK_K]
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def default_blocks(m: int, group: int, fp32: bool) -> tuple[tuple[int, int, int], int]:
    """``((BLOCK_M, BLOCK_N, BLOCK_K), num_warps)``: the fastest of a sweep on an H200 (N = K = 4096,
    group 128; M = 1 and 16 bf16: 40 us, fp32: 136 us; M = 512 bf16: 91 us; cuBLAS bf16 dense 22-32 us,
    so these untuned-for-split-K kernels are latency-bound at decode)."""
    block_k = next(b for b in ((64, 32) if fp32 else (128, 64, 32)) if group % b == 0)
    if m <= 16:
        return ((16, 32, block_k), 2) if fp32 else ((16, 64, block_k), 4)
    return ((64, 64, min(block_k, 64)), 4) if fp32 else ((128, 64, min(block_k, 64)), 4)


def matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, zs: torch.Tensor, group: int,
           bias: torch.Tensor | None = None, *, blocks: tuple[int, int, int] | None = None,
           num_warps: int = 4) -> torch.Tensor:
    """``x [M, K] -> [M, N]`` in fp32 (reference.matmul's result); layout as in reference.py."""
    assert x.dim() == 2 and q.dim() == 2 and x.shape[1] == q.shape[1] * 2, (x.shape, q.shape)
    assert group % 32 == 0 and x.shape[1] % group == 0, (group, x.shape)
    x = x.contiguous()
    m, k = x.shape
    n = q.shape[0]
    y = torch.empty(m, n, dtype=torch.float32, device=x.device)
    if m == 0:
        return y
    if blocks is None:
        blocks, num_warps = default_blocks(m, group, x.dtype == torch.float32)
    block_m, block_n, block_k = blocks  # BLOCK_K must divide the group
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    _int4_matmul_kernel[grid](x, q, scale, zs, bias if bias is not None else y, y, m, n, k, k // group, x.stride(0), y.stride(0),
                              GROUP=group, HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
                              BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return y
