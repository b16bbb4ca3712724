"""Attention over the paged KV cache, in plain torch (the CPU path and the kernels' reference).

The cache of one layer is ``k_cache, v_cache [num_blocks, block_size, Hkv, D]``; sequence ``b``
keeps position ``p`` in block ``block_tables[b, p // block_size]`` at offset ``p % block_size``.
Softmax statistics are fp32 (SDPA accumulates in fp32 for fp32 inputs).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def _select_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """``cache[blocks]`` as ``[W, block_size, Hkv, D]``.

    index_select on a 2-D view (one row per block), not on the 4-D cache and not ``cache[blocks]``
    (advanced indexing is ~30x slower on CPU for this). Measured on a shared 2-core VM with 2
    threads, 24 blocks of [16, 4, 64]: 4-D index_select ~3 ms, 2-D ~0.5 ms (equal with 1 thread).
    """
    return cache.view(cache.shape[0], -1).index_select(0, blocks).view(-1, *cache.shape[1:])


def _gather(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    """``[length, Hkv, D]`` of one sequence from its block ids ``[W]``: a view of the cache when the
    blocks are consecutive ids in order (a long prompt in a cache that had room), else a copy.
    Every chunk of a long prompt gathers its whole prefix per layer: 4096 tokens of the 0.6B
    bench model in chunks of 512 copied ~1.6 GB, 0.34 s of a 21 s prefill."""
    first, count = int(blocks[0]), blocks.numel()
    if int(blocks[-1]) == first + count - 1 and (count < 3 or bool((blocks.diff() == 1).all())):
        return cache[first : first + count].reshape(-1, *cache.shape[2:])[:length]
    return _select_blocks(cache, blocks).reshape(-1, *cache.shape[2:])[:length]


def _gather_batch(k_cache, v_cache, block_tables, longest: int):
    """Every sequence's first ``longest`` positions as ``keys, values [B, L, Hkv, D]`` (positions
    past a sequence's own length hold whatever its table points at: the caller masks them)."""
    num, block_size = block_tables.shape[0], k_cache.shape[1]
    flat = block_tables[:, : (longest + block_size - 1) // block_size].reshape(-1)
    keys = _select_blocks(k_cache, flat).reshape(num, -1, *k_cache.shape[2:])[:, :longest]
    values = _select_blocks(v_cache, flat).reshape(num, -1, *v_cache.shape[2:])[:, :longest]
    return keys, values


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query per sequence over its whole cached context, all sequences at once.

    Args:
        q: ``[B, Hq, D]``; ``Hq`` a multiple of ``Hkv`` (GQA).
        k_cache, v_cache: ``[N, block_size, Hkv, D]``.
        block_tables: ``[B, W]`` int64 block ids (entries past a sequence's length are ignored).
        context_lens: ``[B]`` int64, tokens each query attends to (its own included).
    Returns:
        ``[B, Hq, D]``.
    """
    num = q.shape[0]
    longest = int(context_lens.max())
    keys, values = _gather_batch(k_cache, v_cache, block_tables, longest)
    mask = None
    if num > 1:
        mask = (torch.arange(longest, device=q.device)[None, :] < context_lens[:, None])[:, None, None, :]
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out[:, :, 0, :]


# Chunks of at most this many rows each (speculative verifies, short continuations) run as one
# padded batch instead of one attention call per sequence.
SHORT_QUERIES = 16


def _short_queries(q, k_cache, v_cache, block_tables, counts, context_lens, scale):
    """``paged_prefill_attention`` for several short chunks at once: queries padded to the longest
    chunk ``[B, Hq, n, D]``, keys gathered as in decode, one masked SDPA."""
    num, rows = len(counts), max(counts)
    longest = int(context_lens.max())
    keys, values = _gather_batch(k_cache, v_cache, block_tables, longest)
    counts_t = torch.tensor(counts, device=q.device)
    seq_of = torch.repeat_interleave(torch.arange(num, device=q.device), counts_t)
    row_of = torch.arange(q.shape[0], device=q.device) - torch.repeat_interleave(counts_t.cumsum(0) - counts_t, counts_t)
    padded = q.new_zeros(num, rows, *q.shape[1:])
    padded[seq_of, row_of] = q
    # Row i of sequence b sits at position context_lens[b] - n_b + i and sees keys up to it.
    position = (context_lens - counts_t)[:, None] + torch.arange(rows, device=q.device)[None, :]  # [B, n]
    mask = torch.arange(longest, device=q.device)[None, None, :] <= position[:, :, None]  # [B, n, L]
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask[:, None], scale=scale, enable_gqa=True
    )  # [B, Hq, n, D]
    return out.transpose(1, 2)[seq_of, row_of]


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
    sits at position ``context_lens[b] - n + i`` and sees keys ``0 ..`` that position.

    Args:
        q: ``[T, Hq, D]``.
        k_cache, v_cache: ``[N, block_size, Hkv, D]`` (this step's K/V already written).
        block_tables: ``[B, W]`` int64; query_start: ``[B + 1]`` int64; context_lens: ``[B]`` int64.
    Returns:
        ``[T, Hq, D]``.
    """
    starts, lens = query_start.tolist(), context_lens.tolist()
    counts = [hi - lo for lo, hi in zip(starts, starts[1:])]
    if len(counts) > 1 and max(counts) <= SHORT_QUERIES:
        return _short_queries(q, k_cache, v_cache, block_tables, counts, context_lens, scale)
    if len(counts) > 1 and counts == lens and _flash_cpu_usable(q):
        return _fresh_prompts(q, k_cache, v_cache, block_tables, counts, scale)
    out = torch.empty_like(q)
    block_size = k_cache.shape[1]
    for b, total in enumerate(lens):
        lo, hi = starts[b], starts[b + 1]
        used = block_tables[b, : (total + block_size - 1) // block_size]
        keys = _gather(k_cache, used, total)  # [L, Hkv, D]
        values = _gather(v_cache, used, total)
        out[lo:hi] = chunk_attention(q[lo:hi], keys, values, scale)
    return out


def _fresh_prompts(q, k_cache, v_cache, block_tables, counts: list[int], scale: float) -> torch.Tensor:
    """``paged_prefill_attention`` for chunks that all start at position 0 (new prompts): one
    causal flash call over the batch padded to the longest chunk, instead of three ops per sequence.

    Queries ``[T, Hq, D]`` are scattered into ``[B, n_max, Hq, D]``; keys are whole blocks
    ``[B, W * block_size, Hkv, D]`` gathered in one call per cache. Causality is top-left aligned
    (row ``i`` sees keys ``0 .. i``), so a chunk's real rows never attend to its padding or the
    blocks past its table, which are zeroed all the same (see below); the padded rows' outputs are
    dropped.
    """
    num, rows, block_size = len(counts), max(counts), k_cache.shape[1]
    width = -(-rows // block_size)
    flat = block_tables[:, :width].reshape(-1)
    keys = _select_blocks(k_cache, flat).view(num, width * block_size, *k_cache.shape[2:])[:, :rows]
    values = _select_blocks(v_cache, flat).view(num, width * block_size, *v_cache.shape[2:])[:, :rows]
    counts_t = torch.tensor(counts, device=q.device)
    # The flash kernel adds its causal mask to computed scores: a NaN key past a prompt (a tail or
    # table padding never written) would reach the real rows of its block, so those keys are zeroed.
    past = (torch.arange(rows, device=q.device)[None, :] >= counts_t[:, None])[:, :, None, None]  # [B, n_max, 1, 1]
    keys, values = keys.masked_fill(past, 0), values.masked_fill(past, 0)
    first = counts_t.cumsum(0) - counts_t
    row_of = torch.arange(q.shape[0], device=q.device) - torch.repeat_interleave(first, counts_t)
    index = torch.repeat_interleave(torch.arange(num, device=q.device) * rows, counts_t) + row_of  # [T] into [B * n_max]
    padded = q.new_zeros(num * rows, *q.shape[1:]).index_copy_(0, index, q).view(num, rows, *q.shape[1:])
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        padded.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), 0.0, True, scale=scale
    )  # [B, Hq, n_max, D], laid out as [B, n_max, Hq, D]
    return out.transpose(1, 2).reshape(num * rows, *q.shape[1:]).index_select(0, index)


def _flash_cpu(q, k, v, causal: bool, scale: float):
    """``(out [n, Hq, D], logsumexp [Hq, n] fp32)`` of SDPA over ``[n|L, H, D]`` inputs (GQA)."""
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], 0.0, causal, scale=scale
    )
    return out[0].transpose(0, 1), lse[0]


def _flash_cpu_usable(q: torch.Tensor) -> bool:
    return q.device.type == "cpu" and q.dtype in (torch.float32, torch.bfloat16, torch.float16)


# torch's CPU flash kernel tiles a call's queries by 256 rows from this many on (by 64 below, by 32
# below 192): per key, a 512-row call ran at 0.84x the rate of a 768-row one (Hq 16 / Hkv 8,
# D 128, 4096 keys, 2 threads, Intel Xeon). Its causal flag skips nothing at 512 rows either (it
# ran as long as the unmasked call), so a 512-token chunk after a long prefix paid twice.
FLASH_CPU_WIDE_QUERIES = 768
# The largest additive mask `_folded_chunk` builds (and caches, see `_chunk_mask`); past it a chunk
# takes the split path (prefix unmasked + own rows causal, merged).
CHUNK_MASK_MAX_BYTES = 64 << 20


def _chunk_mask_bytes(q: torch.Tensor, keys: torch.Tensor) -> int:
    return q.shape[0] * (q.shape[1] // keys.shape[1]) * keys.shape[0] * q.element_size()


def _folded_chunk(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """`chunk_attention` of a chunk shorter than `FLASH_CPU_WIDE_QUERIES` after a prefix, as one
    flash call: the ``Hq / Hkv`` query heads that read one KV head are folded into its query rows
    (``[Hkv, Hq / Hkv * n, D]``), which lifts the call into the kernel's wide query tiles, and an
    additive mask stands for causality (``-inf`` above the diagonal of the chunk's own keys). It
    computes the few masked scores of the own block and merges nothing; on the 0.6B bench shapes
    a 4096-token prompt's attention in chunks of 512 ran at 0.97x the rate of one causal call,
    against 0.83x split and merged."""
    n, hq, d = q.shape
    total, hkv = keys.shape[0], keys.shape[1]
    group = hq // hkv
    folded = q.reshape(n, hkv, group, d).permute(1, 2, 0, 3).reshape(1, hkv, group * n, d)
    out, _ = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        folded, keys.transpose(0, 1)[None], values.transpose(0, 1)[None], 0.0, False,
        attn_mask=_chunk_mask(n, total, group, q.dtype, q.device), scale=scale,
    )
    return out[0].reshape(hkv, group, n, d).permute(2, 0, 1, 3).reshape(n, hq, d)


@functools.lru_cache(maxsize=4)
def _chunk_mask(n: int, total: int, group: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``[group * n, total]``: 0 where row ``i % n`` of a chunk at positions ``total - n ..`` sees a
    key, ``-inf`` past its own position. Cached: every layer of a step asks for the same one."""
    mask = torch.zeros(n, total, dtype=dtype, device=device)
    mask[:, total - n :].masked_fill_(torch.ones(n, n, dtype=torch.bool, device=device).triu_(1), float("-inf"))
    return mask.repeat(group, 1)


def chunk_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of one chunk's ``n`` queries ``q [n, Hq, D]`` over its sequence's first
    ``L`` keys and values ``[L, Hkv, D]``: the chunk holds positions ``L - n .. L - 1``.

    On CPU, a chunk of fewer than `FLASH_CPU_WIDE_QUERIES` rows after a prefix takes one flash call
    with its heads folded into its rows and a cached additive mask (`_folded_chunk`). Otherwise the
    chunk's own ``n x n`` keys run with ``is_causal`` (the flash kernel skips the blocks above the
    diagonal at such sizes), the cached prefix ``n x (L - n)`` runs unmasked, and the two partial
    results are merged by their log-sum-exps; for a whole prompt (no prefix) a mask would compute
    every block, twice the work. Elsewhere: one SDPA with a boolean mask.
    """
    n, total = q.shape[0], keys.shape[0]
    prefix = total - n
    if n == 1:  # a decode-like row sees every key
        return F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), scale=scale, enable_gqa=True
        ).transpose(0, 1)
    if not _flash_cpu_usable(q):
        mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=prefix)
        return F.scaled_dot_product_attention(
            q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), attn_mask=mask, scale=scale, enable_gqa=True
        ).transpose(0, 1)
    if 0 < prefix and n < FLASH_CPU_WIDE_QUERIES and _chunk_mask_bytes(q, keys) <= CHUNK_MASK_MAX_BYTES:
        return _folded_chunk(q, keys, values, scale)
    own, own_lse = _flash_cpu(q, keys[prefix:], values[prefix:], True, scale)
    if prefix == 0:
        return own
    past, past_lse = _flash_cpu(q, keys[:prefix], values[:prefix], False, scale)
    # out = (e^a * own + e^b * past) / (e^a + e^b), a and b the two parts' log-sum-exps [Hq, n]
    top = torch.maximum(own_lse, past_lse)
    w_own, w_past = (own_lse - top).exp_(), (past_lse - top).exp_()
    norm = w_own + w_past
    w_own, w_past = (w_own / norm).transpose(0, 1)[..., None], (w_past / norm).transpose(0, 1)[..., None]  # [n, Hq, 1]
    return (own.float() * w_own + past.float() * w_past).to(q.dtype)


def paged_decode_attention_static(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`paged_decode_attention` with shapes fixed by the inputs' shapes, never by their values.

    A captured decode step (a CUDA graph, a ``torch.compile``'d step) cannot size a gather by
    ``context_lens.max()`` (a host read): this variant gathers the whole table width ``W`` of
    every row, ``[B, W * block_size]`` positions, and masks each row by its context length. Keys
    and values past a row's length are zeroed before use, so whatever the table points at there
    (a garbage id, a block never written, NaN) cannot reach the output. A row with an empty
    context (``context_lens[b] == 0``) gives zeros, as the Triton kernel does.

    Args:
        q: ``[B, Hq, D]``; k_cache, v_cache: ``[N, block_size, Hkv, D]``.
        block_tables: ``[B, W]`` int64, every entry a valid block id (padding points anywhere in
            the cache); context_lens: ``[B]`` int64, at most ``W * block_size``.
    Returns:
        ``[B, Hq, D]``.
    """
    num, width = block_tables.shape
    span = width * k_cache.shape[1]
    flat = block_tables.reshape(-1)
    keys = k_cache.index_select(0, flat).reshape(num, span, *k_cache.shape[2:])
    values = v_cache.index_select(0, flat).reshape(num, span, *v_cache.shape[2:])
    live = torch.arange(span, device=q.device)[None, :] < context_lens[:, None]  # [B, L]
    keys = torch.where(live[:, :, None, None], keys, 0)
    values = torch.where(live[:, :, None, None], values, 0)
    out = F.scaled_dot_product_attention(
        q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=live[:, None, None, :],
        scale=scale, enable_gqa=True,
    )[:, :, 0, :]
    return torch.where((context_lens > 0)[:, None, None], out, 0)
