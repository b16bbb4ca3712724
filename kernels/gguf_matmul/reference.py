"""Plain-torch GGUF (llama.cpp) block dequantization and the GEMV's and GEMM's math: the CPU/GPU
fallback and the tests' reference.

``blocks [N, row_bytes]`` uint8 holds the K / elems blocks of each weight row exactly as in the
file (``row_bytes = K / elems * bytes``, `SIZES`). Every op here runs on whole tensors (all blocks
at once, any device). The dequantization rounds as ggml and ``gguf.quants`` do, step by step in
fp32 with the fp16 scales widened exactly: e.g. Q4_K is ``(d * sc) * q - (dmin * m)``, so the C++
``gguf_dequantize`` matches it bitwise. The layouts are described in this folder's README.
"""

from __future__ import annotations

import torch

Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q2_K, Q3_K, Q4_K, Q5_K, Q6_K = 2, 3, 6, 7, 8, 10, 11, 12, 13, 14

# qtype -> (elements per block, bytes per block), as gguf.constants.GGML_QUANT_SIZES
SIZES: dict[int, tuple[int, int]] = {
    Q4_0: (32, 18), Q4_1: (32, 20), Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34),
    Q2_K: (256, 84), Q3_K: (256, 110), Q4_K: (256, 144), Q5_K: (256, 176), Q6_K: (256, 210),
}
NAMES = {Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1", Q8_0: "Q8_0",
         Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K"}
SUPPORTED_TYPES = frozenset(SIZES)

ACT_BLOCK = 32  # activation elements per int16 scale in the GEMV, for the 32-element formats
ACT_MAX = 32767  # the activations' int16 range: [-ACT_MAX, ACT_MAX]
# The types whose GEMV and GEMM round the activations to int8 per superblock of 256 (llama.cpp's
# Q8_K): those of llama.cpp's Q4_K_M files (`round_activations`).
INT8_ACT_TYPES = frozenset({Q4_K, Q6_K})
ACT8_MAX = 127  # their int8 range: [-ACT8_MAX, ACT8_MAX]


def row_bytes(qtype: int, k: int) -> int:
    """Bytes of one weight row of ``k`` elements; raises ValueError for an unknown type or a ``k``
    that is not a whole number of blocks."""
    if qtype not in SIZES:
        raise ValueError(f"gguf_matmul: unsupported qtype {qtype} (supported: {sorted(SIZES)})")
    elems, nbytes = SIZES[qtype]
    if k <= 0 or k % elems:
        raise ValueError(f"gguf_matmul: k={k} must be a positive multiple of {NAMES[qtype]}'s block of {elems}")
    return k // elems * nbytes


def _f16(b: torch.Tensor) -> torch.Tensor:
    """Little-endian fp16 fields ``b [B, 2]`` -> fp32 ``[B, 1]`` (exact)."""
    return b.contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """``qs [..., n]`` -> ``[..., 2n]``: the low nibbles, then the high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _bits(b: torch.Tensor, count: int) -> torch.Tensor:
    """Bit i of the little-endian bytes ``b [B, count // 8]`` at ``[B, count]`` (0 or 1, uint8)."""
    i = torch.arange(count, device=b.device)
    return (b[:, i // 8] >> (i % 8).to(torch.uint8)) & 1


def _crumbs(qs: torch.Tensor) -> torch.Tensor:
    """The 2-bit fields of ``qs [B, 32 * h]`` as ggml's Q2_K/Q3_K lay them out: each 32 bytes give
    128 elements, shift 0 for the first 32, then 2, 4, 6 -> ``[B, 128 * h]``."""
    B = qs.shape[0]
    q = qs.reshape(B, -1, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=qs.device).view(1, 1, 4, 1)
    return (q & 3).reshape(B, -1)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 6-bit scales and mins packed in Q4_K/Q5_K's 12 bytes -> two float ``[B, 8]``."""
    d, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=1)
    return sc.float(), mn.float()


def _dequant_blocks(b: torch.Tensor, qtype: int) -> torch.Tensor:
    """``b [B, bytes]`` uint8, one block a row -> fp32 ``[B, elems]``."""
    B = b.shape[0]
    if qtype == Q8_0:  # d (fp16), qs[32] int8
        return b[:, 2:].contiguous().view(torch.int8).float() * _f16(b[:, 0:2])
    if qtype == Q4_0:  # d, qs[16]: element i < 16 the low nibble of qs[i], i >= 16 the high one of qs[i - 16]
        return _f16(b[:, 0:2]) * (_nibbles(b[:, 2:18]).to(torch.int8) - 8).float()
    if qtype == Q4_1:  # d, m, qs[16]
        return _f16(b[:, 0:2]) * _nibbles(b[:, 4:20]).float() + _f16(b[:, 2:4])
    if qtype == Q5_0:  # d, qh (32 bits: bit 4 of element i), qs[16]
        q = _nibbles(b[:, 6:22]) | (_bits(b[:, 2:6], 32) << 4)
        return _f16(b[:, 0:2]) * (q.to(torch.int8) - 16).float()
    if qtype == Q5_1:  # d, m, qh, qs[16]
        q = _nibbles(b[:, 8:24]) | (_bits(b[:, 4:8], 32) << 4)
        return _f16(b[:, 0:2]) * q.float() + _f16(b[:, 2:4])
    if qtype == Q2_K:  # scales[16] (low nibble scale, high min, per 16), qs[64], d, dmin
        sc = b[:, 0:16]
        dl = (_f16(b[:, 80:82]) * (sc & 15).float()).view(B, 16, 1)
        ml = (_f16(b[:, 82:84]) * (sc >> 4).float()).view(B, 16, 1)
        q = _crumbs(b[:, 16:80]).view(B, 16, 16).float()
        return (dl * q - ml).view(B, 256)
    if qtype == Q3_K:  # hmask[32], qs[64], scales[12] (16 6-bit, biased by 32), d
        s = b[:, 96:108]
        lo = torch.cat([s[:, 0:8] & 15, s[:, 0:8] >> 4], dim=1)
        hi = (s[:, 8:12].reshape(B, 1, 4) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 4, 1))
        hi = (hi & 3).reshape(B, 16)
        scales = ((lo | (hi << 4)).to(torch.int8) - 32).float()
        dl = (_f16(b[:, 108:110]) * scales).view(B, 16, 1)
        hbit = (b[:, 0:32].reshape(B, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)) & 1
        q = _crumbs(b[:, 32:96]).to(torch.int8) - ((hbit.reshape(B, 256) ^ 1) << 2).to(torch.int8)
        return (dl * q.view(B, 16, 16).float()).view(B, 256)
    if qtype in (Q4_K, Q5_K):  # d, dmin, scales[12], (Q5_K: qh[32]), qs[128]
        sc, mn = _k_scale_min(b[:, 4:16])
        d = (_f16(b[:, 0:2]) * sc).view(B, 8, 1)
        dm = (_f16(b[:, 2:4]) * mn).view(B, 8, 1)
        qs = b[:, 16:144] if qtype == Q4_K else b[:, 48:176]
        q = _nibbles(qs.reshape(B, 4, 32)).view(B, 8, 32)  # sub-block 2g low nibbles of group g, 2g + 1 high
        if qtype == Q5_K:
            hbit = (b[:, 16:48].reshape(B, 1, 32) >> torch.arange(8, dtype=torch.uint8, device=b.device).view(1, 8, 1)) & 1
            q = q | (hbit << 4)
        return (d * q.float() - dm).view(B, 256)
    if qtype == Q6_K:  # ql[128], qh[64], scales[16] int8, d
        ql = b[:, 0:128].reshape(B, 2, 2, 32)  # half, 32-byte piece
        low = torch.stack([ql[:, :, 0] & 15, ql[:, :, 1] & 15, ql[:, :, 0] >> 4, ql[:, :, 1] >> 4], dim=2)  # [B, 2, 4, 32]
        qh = b[:, 128:192].reshape(B, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=b.device).view(1, 1, 4, 1)
        q = (low | ((qh & 3) << 4)).to(torch.int8) - 32
        d = (_f16(b[:, 208:210]) * b[:, 192:208].contiguous().view(torch.int8).float()).view(B, 16, 1)
        return (d * q.reshape(B, 16, 16).float()).view(B, 256)
    raise ValueError(f"gguf_matmul: unsupported qtype {qtype} (supported: {sorted(SIZES)})")


def act_group(qtype: int) -> int:
    """Activation elements per int16 scale in the GEMV for weights of ``qtype``: 32 for the
    32-element formats, 256 (one superblock) for the K-quants, whose integer dots then add up over a
    whole superblock before one fp32 conversion (the error stays ~ max|x| over the 256 / 65534,
    still far below llama.cpp's int8 per 256)."""
    if qtype not in SIZES:
        raise ValueError(f"gguf_matmul: unsupported qtype {qtype} (supported: {sorted(SIZES)})")
    return SIZES[qtype][0]


def _check_blocks(blocks: torch.Tensor, qtype: int, k: int) -> None:
    rb = row_bytes(qtype, k)
    if blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != rb:
        raise ValueError(f"gguf_matmul: blocks must be uint8 [N, {rb}] for {NAMES[qtype]} with k={k}, "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")


def dequantize(blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """``blocks [N, row_bytes]`` uint8 -> the weight ``[N, k]`` fp32."""
    _check_blocks(blocks, qtype, k)
    elems, nbytes = SIZES[qtype]
    n = blocks.shape[0]
    return _dequant_blocks(blocks.reshape(n * (k // elems), nbytes), qtype).reshape(n, k)


def quantize_activations(x: torch.Tensor, group: int = ACT_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` fp32 (K a multiple of ``group``) -> ``xq [M, K]`` int16 and ``scale [M, K / group]``
    fp32, per ``group``-element block (32, or 256 for the K-quants: `act_group`): scale = max|x| /
    32767, xq = round(x / scale) (nearest even) in [-32767, 32767]; an all-zero group has scale 0
    and xq 0. ``xq * scale`` approximates ``x`` to 1 / 65534 of the group's max|x|.

    int16, not llama.cpp's int8 (max|x| / 127): on SmolLM2-135M the int8 rounding gave 0.5-1.7%
    relative error per linear, and over its 30 layers the greedy answer to "What is the capital of
    France?" flipped at a near tie (dense logits "The" 25.33 vs "L" 25.24; int8 24.23 vs 24.63)."""
    M, K = x.shape
    if group <= 0 or group % ACT_BLOCK:
        raise ValueError(f"gguf_matmul: activation group {group} must be a positive multiple of {ACT_BLOCK}")
    if K % group:
        raise ValueError(f"gguf_matmul: K={K} must be a multiple of the activation group {group}")
    xq, scale = _round_groups(x, group, ACT_MAX)
    return xq.to(torch.int16), scale


def _round_groups(x: torch.Tensor, group: int, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` rounded per ``group`` elements to integers in [-limit, limit] (nearest even),
    still fp32, and the scales ``[M, K / group]`` (max|x| / limit; 0 for an all-zero group, whose
    values are 0)."""
    M, K = x.shape
    xb = x.float().reshape(M, K // group, group)
    scale = xb.abs().amax(dim=-1) / float(limit)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    xq = torch.round(xb / safe.unsqueeze(-1)).clamp(-limit, limit)
    xq = torch.where(scale.unsqueeze(-1) > 0, xq, torch.zeros_like(xq))
    return xq.reshape(M, K), scale


def gguf_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """What the C++ ``gguf_gemv`` and ``gguf_gemm`` compute (up to fp32 summation order): ``x``
    rounded to int16 per `act_group` (32 elements, or a K-quant's superblock of 256;
    `quantize_activations`), or for `INT8_ACT_TYPES` (Q4_K, Q6_K) to int8 per superblock as
    llama.cpp does (`quantize_activations_int8`: about 1e-2 relative error on random data against
    int16's 2e-5, for half the integer multiplies), times the dequantized weight, plus bias -> ``[M, N]`` fp32."""
    xq, scale, group = round_activations(x, qtype)
    M = x.shape[0]
    xd = (xq.float().reshape(M, -1, group) * scale.unsqueeze(-1)).reshape(M, k)
    y = xd @ dequantize(blocks, qtype, k).T
    return y + bias if bias is not None else y


def quantize_activations_int8(x: torch.Tensor, group: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` fp32 -> ``xq [M, K]`` int8 and ``scale [M, K / group]`` fp32: as
    `quantize_activations` with ``max|x| / 127`` (llama.cpp's Q8_K for ``group`` 256), xq in
    [-127, 127]; an all-zero group has scale 0 and xq 0."""
    M, K = x.shape
    if group <= 0 or K % group:
        raise ValueError(f"gguf_matmul: K={K} must be a multiple of the activation group {group}")
    xq, scale = _round_groups(x, group, ACT8_MAX)
    return xq.to(torch.int8), scale


def round_activations(x: torch.Tensor, qtype: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The C++ ops' rounding of ``x [M, K]`` for weights of ``qtype``: ``(xq, scale, group)``,
    int8 per 256 for `INT8_ACT_TYPES`, else int16 per `act_group`."""
    if qtype in INT8_ACT_TYPES:
        return (*quantize_activations_int8(x, 256), 256)
    group = act_group(qtype)
    return (*quantize_activations(x, group), group)


def gguf_matmul_exact(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ dequantize(blocks).T + bias`` in fp32 (no activation rounding)."""
    y = x.float() @ dequantize(blocks, qtype, k).T
    return y + bias if bias is not None else y
