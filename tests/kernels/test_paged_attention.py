"""Paged attention in Triton against the torch reference: ragged batches, GQA, odd head dims,
shuffled block tables whose unused blocks, tails and padded columns are NaN (never to be read)."""

from __future__ import annotations

import pytest
import torch

from layerzoo.kernels import backends_of
from layerzoo.kernels.paged_attention import reference
from layerzoo.testing import assert_close

tri = pytest.importorskip("layerzoo.kernels.paged_attention.triton")

HKV = 2
RATIO = {torch.float32: 1e-5, torch.float16: 2e-2, torch.bfloat16: 2e-2}


def make_cache(lens, block_size, D, dtype, device, spare=3, seed=0):
    """``(k, v, k_ref, v_ref, block_tables)`` for sequences of ``lens`` tokens.

    Block ids are a shuffled permutation of the used blocks; every table has two padded columns
    beyond its longest row, and each row's unused columns hold garbage ids of the ``spare`` blocks
    past the used ones. Unused blocks and each last block's tail are NaN in ``k, v``; the
    reference gets ``k_ref, v_ref`` with zeros there (it gathers whole blocks).
    """
    gen = torch.Generator().manual_seed(seed)
    used = [-(-n // block_size) for n in lens]
    total = sum(used)
    N, W = total + spare, max(used) + 2
    k = torch.randn(N, block_size, HKV, D, generator=gen)
    v = torch.randn(N, block_size, HKV, D, generator=gen)
    k[total:], v[total:] = float("nan"), float("nan")
    ids = torch.randperm(total, generator=gen)
    tables = torch.randint(total, N, (len(lens), W), generator=gen)
    first = 0
    for b, (n, u) in enumerate(zip(lens, used)):
        tables[b, :u] = ids[first : first + u]
        first += u
        if n % block_size:  # the tail of the last block is not this sequence's
            k[tables[b, u - 1], n % block_size :] = float("nan")
            v[tables[b, u - 1], n % block_size :] = float("nan")
    k, v = k.to(dtype).to(device), v.to(dtype).to(device)
    return k, v, k.nan_to_num(0.0), v.nan_to_num(0.0), tables.to(device)


DECODE_CASES = [  # (block_size, G = Hq / Hkv, D, dtype)
    (4, 1, 16, torch.float32),
    (16, 2, 40, torch.float32),
    (4, 4, 64, torch.float32),
    (16, 1, 64, torch.float16),
    (4, 2, 16, torch.float16),
    (16, 4, 40, torch.bfloat16),
    (4, 2, 64, torch.bfloat16),
]


def _id(case):
    bs, G, D, dtype = case
    return f"bs{bs}-G{G}-D{D}-{str(dtype).removeprefix('torch.')}"


@pytest.mark.parametrize("case", DECODE_CASES, ids=_id)
def test_decode_matches_reference(case, device, nan_empty):
    bs, G, D, dtype = case
    lens = [1, 5, 16, 17, 63, 100]
    k, v, k_ref, v_ref, tables = make_cache(lens, bs, D, dtype, device)
    q = torch.randn(len(lens), HKV * G, D).to(dtype).to(device)
    context_lens = torch.tensor(lens, device=device)
    out = tri.paged_decode_attention(q, k, v, tables, context_lens, D**-0.5)
    ref = reference.paged_decode_attention(q, k_ref, v_ref, tables, context_lens, D**-0.5)
    assert_close("o", ref, out, RATIO[dtype])


def test_decode_strided_query_and_empty_context(device, nan_empty):
    """A non-contiguous ``q`` works; a zero-length context (a padded CUDA-graph row) gives zeros."""
    lens, D = [0, 17, 9], 40
    k, v, k_ref, v_ref, tables = make_cache([max(n, 1) for n in lens], 4, D, torch.float32, device)
    q = torch.randn(len(lens), HKV * 2, D + 8, device=device)[..., :D]
    context_lens = torch.tensor(lens, device=device)
    out = tri.paged_decode_attention(q, k, v, tables, context_lens, 0.3)
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    ref = reference.paged_decode_attention(q[1:], k_ref, v_ref, tables[1:], context_lens[1:], 0.3)
    assert_close("o", ref, out[1:])


PREFILL_CASES = [  # (block_size, G, D, dtype)
    (16, 1, 16, torch.float32),
    (4, 2, 40, torch.float32),
    (16, 4, 64, torch.float32),
    (4, 1, 40, torch.float16),
    (16, 2, 64, torch.bfloat16),
    (4, 4, 16, torch.bfloat16),
]
# (cached prefix, chunk length): chunks of 1, 3 and 17 rows, with and without a prefix
CHUNKS = [(0, 1), (0, 3), (0, 17), (5, 1), (16, 3), (46, 17), (83, 17)]


@pytest.mark.parametrize("case", PREFILL_CASES, ids=_id)
def test_prefill_matches_reference(case, device, nan_empty):
    bs, G, D, dtype = case
    lens = [p + n for p, n in CHUNKS]
    k, v, k_ref, v_ref, tables = make_cache(lens, bs, D, dtype, device)
    starts = torch.tensor([0] + [n for _, n in CHUNKS], device=device).cumsum(0)
    q = torch.randn(int(starts[-1]), HKV * G, D).to(dtype).to(device)
    context_lens = torch.tensor(lens, device=device)
    out = tri.paged_prefill_attention(q, k, v, tables, starts, context_lens, D**-0.5)
    ref = reference.paged_prefill_attention(q, k_ref, v_ref, tables, starts, context_lens, D**-0.5)
    assert_close("o", ref, out, RATIO[dtype])


def test_prefill_strided_query_single_sequence(device, nan_empty):
    """One 40-token chunk after a 9-token prefix, from a non-contiguous ``q`` (a fused-QKV view)."""
    D, G = 40, 2
    k, v, k_ref, v_ref, tables = make_cache([49], 16, D, torch.float32, device)
    qkv = torch.randn(40, HKV * G + 2 * HKV, D, device=device)
    q = qkv[:, : HKV * G]
    starts, context_lens = torch.tensor([0, 40], device=device), torch.tensor([49], device=device)
    out = tri.paged_prefill_attention(q, k, v, tables, starts, context_lens, D**-0.5)
    ref = reference.paged_prefill_attention(q, k_ref, v_ref, tables, starts, context_lens, D**-0.5)
    assert_close("o", ref, out)


def test_unsupported_dtype_falls_back():
    from layerzoo.errors import KernelUnsupported

    q, cache = torch.randn(1, 2, 16), torch.zeros(2, 4, 2, 16, dtype=torch.float64)
    tables, lens = torch.zeros(1, 1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(KernelUnsupported, match="fp16/bf16/fp32"):
        tri.paged_decode_attention(q, cache, cache, tables, lens, 1.0)


@pytest.mark.parametrize("op", ["paged_decode_attention", "paged_prefill_attention"])
def test_registry_lists_triton_backend(op):
    from layerzoo.plugins.manager import PluginRegistry

    assert backends_of(op)["triton"] == f"layerzoo.kernels.paged_attention.triton:{op}"
    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": ""})
    registry.load()
    reg = registry.kernels.entries[(op, "triton")]
    assert reg.plugin == "layerzoo.kernels" and reg.target == backends_of(op)["triton"]


@pytest.mark.parametrize("chunks", [[(5, 1), (16, 3), (0, 2), (40, 5)], [(0, 4), (31, 16)]])
def test_short_chunks_batched_match_one_call_per_sequence(chunks, monkeypatch):
    """The reference runs several short chunks (speculative verifies) as one padded batch: the same
    result as attending sequence by sequence."""
    lens = [p + n for p, n in chunks]
    k, v, k_ref, v_ref, tables = make_cache(lens, 4, 16, torch.float32, "cpu")
    starts = torch.tensor([0] + [n for _, n in chunks]).cumsum(0)
    q = torch.randn(int(starts[-1]), HKV * 2, 16)
    context_lens = torch.tensor(lens)
    batched = reference.paged_prefill_attention(q, k_ref, v_ref, tables, starts, context_lens, 0.25)
    monkeypatch.setattr(reference, "SHORT_QUERIES", 0)
    looped = reference.paged_prefill_attention(q, k_ref, v_ref, tables, starts, context_lens, 0.25)
    torch.testing.assert_close(batched, looped, atol=1e-5, rtol=1e-5)
