"""Attention over the paged KV cache in Triton: decode and varlen causal prefill.

Same ops, signatures and semantics as ``reference.py`` (see the README). Both kernels gather keys
token by token through the block table, so a key tile of ``BN`` tokens may span several cache
blocks and any ``block_size`` works (4, 16, not a power of two...). Softmax statistics
(``b_m``, ``b_l``) and the accumulator are fp32; the dot products run in the storage dtype on a
GPU (fp16/bf16, fp32 accumulation) and in fp32 for fp32 storage or under the interpreter (whose
bf16 arithmetic is wrong on this machine).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from layerzoo import settings
from layerzoo.errors import KernelUnsupported

# exp(x) == exp2(x * log2(e)): the kernels fold log2(e) into the scale and use exp2.
LOG2E = 1.4426950408889634


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    # fp32 inputs default to tf32 on a GPU (10-bit mantissa): too coarse for fp32 storage.
    if IEEE:
        return tl.dot(a, b, input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _attend_tile(
    b_q, b_m, b_l, b_acc, k_cache, v_cache, block_tables, o_t, m_t, m_s, o_d, m_d, qk_scale,
    stride_kn, stride_ks, stride_vn, stride_vs,
    BLOCK_SIZE: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """One online-softmax step over the key tokens ``o_t`` (valid where ``m_t``; scores kept
    where ``m_s``). ``k_cache``/``v_cache`` already point at the KV head and ``block_tables`` at
    the sequence's row."""
    # block ids of the tile's tokens; masked lanes never read the table (nor its garbage tail)
    b_blk = tl.load(block_tables + o_t // BLOCK_SIZE, mask=m_t, other=0)
    o_slot = o_t % BLOCK_SIZE
    # [BD, BN]
    p_k = k_cache + b_blk[None, :] * stride_kn + o_slot[None, :] * stride_ks + o_d[:, None]
    b_k = tl.load(p_k, mask=m_d[:, None] & m_t[None, :], other=0.0)
    # [BN, BD]
    p_v = v_cache + b_blk[:, None] * stride_vn + o_slot[:, None] * stride_vs + o_d[None, :]
    b_v = tl.load(p_v, mask=m_t[:, None] & m_d[None, :], other=0.0)
    if DOT_FP32:
        b_k, b_v = b_k.to(tl.float32), b_v.to(tl.float32)
    # [BM, BD] @ [BD, BN] -> [BM, BN]
    b_s = _dot(b_q, b_k, DOT_FP32) * qk_scale
    b_s = tl.where(m_s, b_s, float("-inf"))
    # b_m starts finite (-1e30), so a row with no key yet gives exp2(-inf) = 0, never NaN
    b_mn = tl.maximum(b_m, tl.max(b_s, 1))
    b_r = tl.exp2(b_m - b_mn)
    b_p = tl.exp2(b_s - b_mn[:, None])
    b_l = b_l * b_r + tl.sum(b_p, 1)
    # [BM, BN] @ [BN, BD] -> [BM, BD]
    b_acc = b_acc * b_r[:, None] + _dot(b_p.to(b_v.dtype), b_v, DOT_FP32)
    return b_mn, b_l, b_acc


@triton.jit
def paged_decode_kernel(
    q, k_cache, v_cache, o, block_tables, context_lens, qk_scale,
    stride_qb, stride_qh, stride_ob, stride_oh,
    stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh, stride_bt,
    G: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BH: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """One program per (sequence, KV head): the ``G`` query heads of the group, padded to ``BH``
    rows, attend over the sequence's ``context_lens[b]`` cached tokens, ``BN`` at a time."""
    i_b, i_hk = tl.program_id(0), tl.program_id(1)
    L = tl.load(context_lens + i_b)
    o_h, o_d, o_n = tl.arange(0, BH), tl.arange(0, BD), tl.arange(0, BN)
    m_h, m_d = o_h < G, o_d < D

    # [BH, BD]
    p_q = q + i_b * stride_qb + (i_hk * G + o_h[:, None]) * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_h[:, None] & m_d[None, :], other=0.0)
    if DOT_FP32:
        b_q = b_q.to(tl.float32)
    b_m = tl.full([BH], -1e30, dtype=tl.float32)
    b_l = tl.zeros([BH], dtype=tl.float32)
    b_acc = tl.zeros([BH, BD], dtype=tl.float32)
    for start in range(0, L, BN):
        o_t = start + o_n
        m_t = o_t < L
        b_m, b_l, b_acc = _attend_tile(
            b_q, b_m, b_l, b_acc, k_cache + i_hk * stride_kh, v_cache + i_hk * stride_vh,
            block_tables + i_b * stride_bt, o_t, m_t, m_t[None, :], o_d, m_d, qk_scale,
            stride_kn, stride_ks, stride_vn, stride_vs, BLOCK_SIZE, DOT_FP32,
        )
    # an empty context (L == 0) gives zeros rather than 0/0
    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
    p_o = o + i_b * stride_ob + (i_hk * G + o_h[:, None]) * stride_oh + o_d[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_h[:, None] & m_d[None, :])


@triton.jit
def paged_prefill_kernel(
    q, k_cache, v_cache, o, block_tables, query_start, context_lens, qk_scale,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kn, stride_ks, stride_kh, stride_vn, stride_vs, stride_vh, stride_bt,
    G: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, DOT_FP32: tl.constexpr,
):
    """One program per (query tile of ``BM`` rows, query head, sequence). Row ``i`` of sequence
    ``b`` sits at position ``context_lens[b] - n_b + i``; the key loop stops after the tile's
    last row's position."""
    i_t, i_h, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bos = tl.load(query_start + i_b)
    n = tl.load(query_start + i_b + 1) - bos
    if i_t * BM >= n:
        return
    L = tl.load(context_lens + i_b)
    prefix = L - n
    o_m, o_d, o_n = i_t * BM + tl.arange(0, BM), tl.arange(0, BD), tl.arange(0, BN)
    m_m, m_d = o_m < n, o_d < D
    pos = prefix + o_m

    # [BM, BD]
    p_q = q + (bos + o_m[:, None]) * stride_qt + i_h * stride_qh + o_d[None, :]
    b_q = tl.load(p_q, mask=m_m[:, None] & m_d[None, :], other=0.0)
    if DOT_FP32:
        b_q = b_q.to(tl.float32)
    b_m = tl.full([BM], -1e30, dtype=tl.float32)
    b_l = tl.zeros([BM], dtype=tl.float32)
    b_acc = tl.zeros([BM, BD], dtype=tl.float32)
    # keys up to the tile's last row's position: the early stop of the causal loop
    end = tl.minimum(L, prefix + (i_t + 1) * BM)
    i_hk = i_h // G
    for start in range(0, end, BN):
        o_t = start + o_n
        m_t = o_t < end
        b_m, b_l, b_acc = _attend_tile(
            b_q, b_m, b_l, b_acc, k_cache + i_hk * stride_kh, v_cache + i_hk * stride_vh,
            block_tables + i_b * stride_bt, o_t, m_t, m_t[None, :] & (o_t[None, :] <= pos[:, None]),
            o_d, m_d, qk_scale, stride_kn, stride_ks, stride_vn, stride_vs, BLOCK_SIZE, DOT_FP32,
        )
    b_o = b_acc / tl.where(b_l > 0, b_l, 1.0)[:, None]
    p_o = o + (bos + o_m[:, None]) * stride_ot + i_h * stride_oh + o_d[None, :]
    tl.store(p_o, b_o.to(o.dtype.element_ty), mask=m_m[:, None] & m_d[None, :])


def _interpreting() -> bool:
    # the kernels above were built by @triton.jit at import, interpreted or compiled
    return _INTERPRET


_INTERPRET = settings.switch("TRITON_INTERPRET")


_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check(q, k_cache, v_cache, block_tables) -> tuple[int, int]:
    """``(G, BD)`` after validating the shared arguments.

    Raises `ValueError` for malformed arguments and `KernelUnsupported` (the op then runs its
    torch reference) for valid ones this kernel does not serve.
    """
    Hq, D = q.shape[-2:]
    Hkv = k_cache.shape[2]
    if k_cache.shape != v_cache.shape or k_cache.dim() != 4 or k_cache.shape[3] != D:
        raise ValueError(
            f"k_cache and v_cache must both be [N, block_size, Hkv, {D}], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv}) for GQA")
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache and v_cache must be contiguous along the head dim")
    if block_tables.dtype not in (torch.int32, torch.int64) or block_tables.stride(-1) != 1:
        raise ValueError("block_tables must be an int32/int64 tensor, contiguous along its rows")
    if q.dtype not in _DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise KernelUnsupported(
            f"paged attention in triton needs q and the cache in one of fp16/bf16/fp32, "
            f"got q {q.dtype}, k_cache {k_cache.dtype}, v_cache {v_cache.dtype}"
        )
    if D > 256:
        raise KernelUnsupported(f"paged attention in triton supports head_dim <= 256, got {D}")
    if q.device.type != "cuda" and not _interpreting():
        raise KernelUnsupported(f"{q.device.type} tensors need TRITON_INTERPRET=1 for the triton kernels")
    return Hq // Hkv, max(16, triton.next_power_of_2(D))


def _dot_fp32(dtype: torch.dtype) -> bool:
    return dtype == torch.float32 or _interpreting()


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its whole cached context (no host sync).

    Args:
        q: ``[B, Hq, D]``; ``Hq`` a multiple of ``Hkv`` (GQA).
        k_cache, v_cache: ``[N, block_size, Hkv, D]``.
        block_tables: ``[B, W]`` int64 block ids (entries past a sequence's length are never read).
        context_lens: ``[B]`` int64, tokens each query attends to (its own included).
        scale: the softmax scale, usually ``D ** -0.5``.
    Returns:
        ``[B, Hq, D]`` in ``q``'s dtype.
    """
    G, BD = _check(q, k_cache, v_cache, block_tables)
    B, Hq, D = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    o = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
    if B == 0:
        return o
    BH = max(16, triton.next_power_of_2(G))
    BN = 16 if _interpreting() else 64
    paged_decode_kernel[(B, k_cache.shape[2])](
        q, k_cache, v_cache, o, block_tables, context_lens, scale * LOG2E,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        G=G, D=D, BLOCK_SIZE=k_cache.shape[1], BH=BH, BN=BN, BD=BD,
        DOT_FP32=_dot_fp32(q.dtype), num_warps=4,
    )
    return o


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Causal attention for chunks of several sequences (varlen), each over its cached prefix too.

    Sequence ``b`` owns query rows ``query_start[b]:query_start[b+1]`` (``n`` rows); its row ``i``
    sits at position ``context_lens[b] - n + i`` and sees keys ``0 ..`` that position. Reads the
    longest chunk length back to the host once, to size the grid.

    Args:
        q: ``[T, Hq, D]``.
        k_cache, v_cache: ``[N, block_size, Hkv, D]`` (this step's K/V already written).
        block_tables: ``[B, W]`` int64; query_start: ``[B + 1]`` int64; context_lens: ``[B]`` int64.
        scale: the softmax scale.
    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype.
    """
    G, BD = _check(q, k_cache, v_cache, block_tables)
    T, Hq, D = q.shape
    q = q if q.stride(-1) == 1 else q.contiguous()
    o = torch.empty((T, Hq, D), dtype=q.dtype, device=q.device)
    B = context_lens.shape[0]
    if T == 0 or B == 0:
        return o
    # under the interpreter small tiles keep it fast and make short test chunks span tiles
    BM, BN = (16, 16) if _interpreting() else (64, 64 if BD <= 128 else 32)
    longest = int((query_start[1:] - query_start[:-1]).max())
    grid = (triton.cdiv(longest, BM), Hq, B)
    paged_prefill_kernel[grid](
        q, k_cache, v_cache, o, block_tables, query_start, context_lens, scale * LOG2E,
        q.stride(0), q.stride(1), o.stride(0), o.stride(1),
        *k_cache.stride()[:3], *v_cache.stride()[:3], block_tables.stride(0),
        G=G, D=D, BLOCK_SIZE=k_cache.shape[1], BM=BM, BN=BN, BD=BD,
        DOT_FP32=_dot_fp32(q.dtype), num_warps=4, num_stages=2,
    )
    return o


def paged_decode_attention_static(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The decode kernel is shape-static already: one program per (row, KV head), the context
    length read on the device, table entries past it never read, an empty context giving zeros."""
    return paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale)
