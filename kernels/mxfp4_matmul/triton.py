"""The MXFP4 expert matmul as a grouped Triton GEMM that dequantizes its weight tiles in the kernel
(CUDA; tested under ``TRITON_INTERPRET=1`` against ``reference.py``).

The rows are sorted by expert and each expert's rows padded to a multiple of ``BLOCK_M``
(`layerzoo.kernels.moe_grouped_matmul.triton.align_by_expert`, torch ops, no host sync), so every
row block belongs to one expert. A program computes a ``[BLOCK_M, BLOCK_N]`` tile of its rows'
outputs: per ``BLOCK_K`` slice it loads the code bytes of its expert's weight rows (weight ``k``:
byte ``k // 2``, high nibble for odd ``k``), turns each E2M1 code into twice its value by integer
arithmetic (``m`` for exponent bits 0, ``(2 + m) << (e - 1)`` otherwise, negated by the sign
bit), multiplies by the group's ``2^(s - 128)`` built from its bits, and multiplies the tile.
fp32 activations multiply in IEEE fp32; bf16/fp16 ones multiply the weight tile in their dtype
(exact: E2M1 times a power of two) on the tensor cores, accumulating in fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerzoo import settings
from layerzoo.errors import KernelUnsupported
from layerzoo.kernels.moe_grouped_matmul.triton import align_by_expert
from layerzoo.kernels.mxfp4_matmul.reference import GROUP, check_layout

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def _interpreting() -> bool:
    return settings.switch("TRITON_INTERPRET")


@triton.jit
def _expert_matmul_kernel(x_ptr, w_ptr, s_ptr, y_ptr, row_of, expert_of_block, R, N, K, stride_xm, stride_ym,
                          IEEE: tl.constexpr, UPCAST: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    i_m, i_n = tl.program_id(0), tl.program_id(1)
    expert = tl.load(expert_of_block + i_m).to(tl.int64)
    if expert < 0:
        return
    rows = tl.load(row_of + i_m * BLOCK_M + tl.arange(0, BLOCK_M))  # int64; R on padding rows
    m_ok = rows < R
    rn = i_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    w_row = expert * N + rn.to(tl.int64)  # [BLOCK_N] rows of the stacked weight
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = n_ok[:, None] & k_ok[None, :]
        byte = tl.load(w_ptr + w_row[:, None] * (K // 2) + (rk // 2)[None, :], mask=w_ok, other=0).to(tl.int32)
        code = (byte >> ((rk % 2) * 4)[None, :]) & 0xF
        exponent, mantissa = (code >> 1) & 3, code & 1
        twice = tl.where(exponent == 0, mantissa, (2 + mantissa) << tl.maximum(exponent - 1, 0))
        twice = tl.where(code >= 8, -twice, twice)
        s = tl.load(s_ptr + w_row[:, None] * (K // 32) + (rk // 32)[None, :], mask=w_ok, other=127).to(tl.int32)
        # 2^(s - 127) from its fp32 bits (s = 0: the subnormal 2^-127)
        scale = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
        w = twice.to(tl.float32) * 0.5 * scale  # [BLOCK_N, BLOCK_K], exact
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        elif UPCAST:  # the interpreter gets bf16 dots wrong: the same exact products in fp32
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(y_ptr + rows[:, None] * stride_ym + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def default_blocks(rows: int, num_experts: int, fp32: bool) -> tuple[tuple[int, int, int], int]:
    """``((BLOCK_M, BLOCK_N, BLOCK_K), num_warps)``: small row blocks when each expert gets few rows
    (decode), larger ones when it gets many (not tuned on a GPU yet)."""
    per_expert = rows / max(1, num_experts)
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    return ((block_m, 32, 32) if fp32 else (block_m, 64, 64)), 4


def expert_matmul(x: torch.Tensor, experts: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, *,
                  blocks: tuple[int, int, int] | None = None, num_warps: int = 4) -> torch.Tensor:
    """`reference.expert_matmul`: ``x [R, K]`` (fp32/bf16/fp16), ``experts [R]`` int64 in ``[0, E)``,
    ``packed [E, N, K/2]``, ``scale [E, N, K/32]`` uint8 → ``[R, N]`` fp32."""
    check_layout(packed, scale)
    if packed.dim() != 3 or x.dim() != 2 or x.shape[1] != packed.shape[2] * 2 or experts.shape != (x.shape[0],):
        raise ValueError(f"expected x [R, K], experts [R], packed [E, N, K/2], got {tuple(x.shape)}, "
                         f"{tuple(experts.shape)}, {tuple(packed.shape)}")
    if x.dtype not in DTYPES:
        raise KernelUnsupported(f"the triton MXFP4 expert matmul takes fp32/fp16/bf16 activations, got {x.dtype}")
    if x.device.type != "cuda" and not _interpreting():
        raise KernelUnsupported(f"{x.device.type} tensors need TRITON_INTERPRET=1 for the triton kernels")
    num_experts, n, k = packed.shape[0], packed.shape[1], packed.shape[2] * 2
    rows = x.shape[0]
    y = torch.empty(rows, n, dtype=torch.float32, device=x.device)
    if rows == 0:
        return y
    fp32 = x.dtype == torch.float32
    if blocks is None:
        blocks, num_warps = default_blocks(rows, num_experts, fp32)
    block_m, block_n, block_k = blocks
    assert block_k % GROUP == 0, block_k
    x, packed, scale = x.contiguous(), packed.contiguous(), scale.contiguous()
    row_of, expert_of_block = align_by_expert(experts.long().reshape(rows, 1), num_experts, block_m)
    grid = (expert_of_block.numel(), triton.cdiv(n, block_n))
    _expert_matmul_kernel[grid](x, packed, scale, y, row_of, expert_of_block, rows, n, k, x.stride(0), y.stride(0),
                                IEEE=fp32, UPCAST=_interpreting() and not fp32,
                                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps)
    return y
