"""The CPU prefill attention (the reference backend): a chunk after a prefix runs as one flash call
with its heads folded into its rows under an additive mask, or (long chunks, masks past their
limit) its own keys causally and its prefix unmasked, merged by log-sum-exp; either must equal
one masked softmax over all keys."""

from __future__ import annotations

import pytest
import torch

from layerzoo.kernels.paged_attention import reference


def dense_causal(q, keys, values, scale):
    """Plain softmax attention, fp64: query ``i`` of ``[n, Hq, D]`` sees keys ``0 .. L - n + i``."""
    n, hq, _ = q.shape
    total, hkv, _ = keys.shape
    k = keys.double().repeat_interleave(hq // hkv, dim=1)
    v = values.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    allowed = torch.ones(n, total, dtype=torch.bool).tril(diagonal=total - n)
    probs = scores.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", probs, v)


@pytest.mark.parametrize("prefix,n", [(0, 1), (0, 7), (0, 33), (5, 1), (9, 3), (17, 29), (40, 17)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_chunk_attention_equals_masked_softmax(prefix, n, dtype, tol):
    gen = torch.Generator().manual_seed(prefix * 100 + n)
    hq, hkv, d = 6, 2, 24
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    keys = torch.randn(prefix + n, hkv, d, generator=gen).to(dtype)
    values = torch.randn(prefix + n, hkv, d, generator=gen).to(dtype)
    out = reference.chunk_attention(q, keys, values, 0.3)
    assert out.shape == (n, hq, d) and out.dtype == dtype
    torch.testing.assert_close(out.double(), dense_causal(q, keys, values, 0.3), atol=tol, rtol=tol)


@pytest.mark.parametrize("route", ["folded", "split"])
@pytest.mark.parametrize("hq,hkv", [(6, 2), (4, 4), (8, 1)], ids=["gqa", "mha", "mqa"])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_both_routes_of_a_chunk_after_a_prefix(route, hq, hkv, dtype, tol, monkeypatch):
    """The folded call (heads into rows, cached mask) and the split-and-merge one give the same
    attention; the folded one builds its mask once for a step's layers."""
    if route == "split":
        monkeypatch.setattr(reference, "CHUNK_MASK_MAX_BYTES", 0)
    reference._chunk_mask.cache_clear()
    gen = torch.Generator().manual_seed(hq * 10 + hkv)
    n, prefix, d = 37, 70, 32
    q = torch.randn(n, hq, d, generator=gen).to(dtype)
    keys = torch.randn(prefix + n, hkv, d, generator=gen).to(dtype)
    values = torch.randn(prefix + n, hkv, d, generator=gen).to(dtype)
    for _layer in range(3):
        out = reference.chunk_attention(q, keys, values, 0.2)
        torch.testing.assert_close(out.double(), dense_causal(q, keys, values, 0.2), atol=tol, rtol=tol)
    masks = reference._chunk_mask.cache_info()
    assert (masks.misses, masks.hits) == ((1, 2) if route == "folded" else (0, 0))


def test_chunk_attention_strided_query():
    """q as the runtime hands it: a column slice of the fused qkv projection, not contiguous."""
    gen = torch.Generator().manual_seed(1)
    n, hq, hkv, d = 19, 4, 2, 16
    qkv = torch.randn(n, (hq + 2 * hkv) * d, generator=gen)
    q = qkv[:, : hq * d].view(n, hq, d)
    keys, values = torch.randn(31, hkv, d, generator=gen), torch.randn(31, hkv, d, generator=gen)
    torch.testing.assert_close(reference.chunk_attention(q, keys, values, 0.25).double(),
                               dense_causal(q, keys, values, 0.25), atol=2e-5, rtol=2e-5)


def test_paged_prefill_long_chunks_over_cached_prefixes():
    """Several long chunks (beyond the padded short-query batch), each after a cached prefix of its
    own, in a shuffled paged cache: every row equals dense attention over its sequence."""
    gen = torch.Generator().manual_seed(2)
    block_size, hq, hkv, d = 4, 4, 2, 16
    chunks = [(0, 21), (13, 18), (30, 25)]  # (cached prefix, new rows)
    lens = [p + n for p, n in chunks]
    used = [-(-n // block_size) for n in lens]
    ids = torch.randperm(sum(used), generator=gen)
    k_cache = torch.randn(sum(used), block_size, hkv, d, generator=gen)
    v_cache = torch.randn(sum(used), block_size, hkv, d, generator=gen)
    tables = torch.zeros(len(lens), max(used), dtype=torch.long)
    first = 0
    for b, u in enumerate(used):
        tables[b, :u] = ids[first : first + u]
        first += u
    starts = torch.tensor([0] + [n for _, n in chunks]).cumsum(0)
    q = torch.randn(int(starts[-1]), hq, d, generator=gen)
    out = reference.paged_prefill_attention(q, k_cache, v_cache, tables, starts, torch.tensor(lens), 0.25)
    for b, total in enumerate(lens):
        keys = k_cache[tables[b, : used[b]]].reshape(-1, hkv, d)[:total]
        values = v_cache[tables[b, : used[b]]].reshape(-1, hkv, d)[:total]
        rows = slice(int(starts[b]), int(starts[b + 1]))
        torch.testing.assert_close(out[rows].double(), dense_causal(q[rows], keys, values, 0.25), atol=2e-5, rtol=2e-5)


def test_fresh_prompts_batched_equal_dense_attention_with_garbage_past_each_table():
    """New prompts of different lengths (all from position 0) run as one padded causal call; blocks
    past a prompt's table hold NaN, which its real rows never see."""
    gen = torch.Generator().manual_seed(3)
    block_size, hq, hkv, d = 4, 6, 3, 8
    lens = [21, 5, 38, 17]
    used = [-(-n // block_size) for n in lens]
    total = sum(used)
    k_cache = torch.randn(total + 2, block_size, hkv, d, generator=gen)
    v_cache = torch.randn(total + 2, block_size, hkv, d, generator=gen)
    k_cache[total:], v_cache[total:] = float("nan"), float("nan")
    ids = torch.randperm(total, generator=gen)
    tables = torch.full((len(lens), max(used)), total, dtype=torch.long)  # padding: a NaN block
    first = 0
    for b, u in enumerate(used):
        tables[b, :u] = ids[first : first + u]
        first += u
    starts = torch.tensor([0] + lens).cumsum(0)
    q = torch.randn(int(starts[-1]), hq, d, generator=gen)
    out = reference.paged_prefill_attention(q, k_cache, v_cache, tables, starts, torch.tensor(lens), 0.3)
    assert bool(torch.isfinite(out).all())
    for b, n in enumerate(lens):
        keys = k_cache[tables[b, : used[b]]].reshape(-1, hkv, d)[:n]
        values = v_cache[tables[b, : used[b]]].reshape(-1, hkv, d)[:n]
        rows = slice(int(starts[b]), int(starts[b + 1]))
        torch.testing.assert_close(out[rows].double(), dense_causal(q[rows], keys, values, 0.3), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("blocks", [[3, 4, 5, 6], [7], [5, 6], [3, 5, 4, 6], [6, 5, 4, 3], [3, 4, 9, 10]], ids=str)
def test_a_sequence_in_consecutive_blocks_is_read_in_place(blocks):
    """Blocks with consecutive ids, in order, are a view of the cache (no copy of a long prefix per
    chunk and layer); any other table is gathered; both give the sequence's rows."""
    gen = torch.Generator().manual_seed(len(blocks))
    cache = torch.randn(12, 4, 2, 8, generator=gen)
    ids = torch.tensor(blocks)
    length = 4 * len(blocks) - 1
    got = reference._gather(cache, ids, length)
    assert torch.equal(got, torch.cat([cache[b] for b in blocks])[:length])
    in_place = got.untyped_storage().data_ptr() == cache.untyped_storage().data_ptr()
    assert in_place == (blocks == list(range(blocks[0], blocks[0] + len(blocks))))
