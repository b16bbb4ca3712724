"""A step whose chunks are all short (decodes beside speculative verifies, short continuations;
with the C++ decode kernel, prompts of up to 256 tokens) attends in one decode call, every row a
query over the keys up to its own position; longer chunks keep the prefill op. Both give the
attention of the reference prefill op."""

import pytest
import torch

from layerzoo.kernels import cpp_build
from layerzoo.kernels.paged_attention import reference
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.kv_cache import KVCacheSpec
from layerzoo.runtime.kv_pool import ROW_QUERY_CHUNK, ROW_QUERY_CHUNK_CPP, PagedKVCache

BS = 4
SCALE = 8**-0.5


def ctx_for(kv, query_lens, context_lens, tables, num_decodes):
    return ForwardContext.for_paged(
        seq_ids=list(range(len(query_lens))), query_lens=query_lens, context_lens=context_lens,
        block_tables=tables, block_size=BS, num_decodes=num_decodes, kv_cache=kv,
    )


def counting(op, calls, name):
    def call(*args):
        calls.append(name)
        return op(*args)

    return call


def attend_step(query_lens, context_lens, num_decodes, seed=0, row_limit=None):
    """Fill the cache with each sequence's earlier tokens, then attend one step; returns the
    output, the reference prefill op's output over the same cache, and which ops ran.
    ``row_limit`` overrides the pool's longest row-query chunk."""
    g = torch.Generator().manual_seed(seed)
    blocks = max(6, -(-max(context_lens) // BS))
    total = len(query_lens) * blocks + 12
    kv = PagedKVCache({0: KVCacheSpec(2, 8, torch.float32)}, total, BS)
    if row_limit is not None:
        kv.row_query_rows = row_limit
    order = torch.randperm(total, generator=torch.Generator().manual_seed(7)).tolist()
    tables = [order[i * blocks : (i + 1) * blocks] for i in range(len(query_lens))]
    earlier = [c - q for q, c in zip(query_lens, context_lens)]
    filled = [i for i, n in enumerate(earlier) if n]
    if filled:  # the earlier tokens, as one step before the spies are set
        fill = ctx_for(kv, [earlier[i] for i in filled], [earlier[i] for i in filled], [tables[i] for i in filled], 0)
        n = sum(earlier)
        kv.attend(0, torch.randn(n, 4, 8, generator=g), torch.randn(n, 2, 8, generator=g),
                  torch.randn(n, 2, 8, generator=g), SCALE, fill)
    calls = []
    kv._decode_op = counting(kv._decode_op, calls, "decode")
    kv._prefill_op = counting(kv._prefill_op, calls, "prefill")
    t = sum(query_lens)
    q, k, v = (torch.randn(t, 4, 8, generator=g), torch.randn(t, 2, 8, generator=g), torch.randn(t, 2, 8, generator=g))
    ctx = ctx_for(kv, query_lens, context_lens, tables, num_decodes)
    out = kv.attend(0, q, k, v, SCALE, ctx)
    want = reference.paged_prefill_attention(q, kv.k[0], kv.v[0], ctx.block_tables, ctx.query_start_tensor(),
                                             ctx.context_lens_tensor, SCALE)
    return out, want, calls


def test_decodes_beside_a_verify_attend_in_one_decode_call():
    out, want, calls = attend_step([1, 5], [11, 17], num_decodes=1)
    assert calls == ["decode"]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_short_chunks_without_decodes_and_a_fresh_short_prompt_too():
    out, want, calls = attend_step([3, 7], [9, 7], num_decodes=0, seed=1)
    assert calls == ["decode"]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_a_chunk_longer_than_the_limit_keeps_the_prefill_op():
    out, want, calls = attend_step([1, ROW_QUERY_CHUNK + 1], [6, ROW_QUERY_CHUNK + 3], num_decodes=1, seed=2,
                                   row_limit=ROW_QUERY_CHUNK)
    assert calls == ["decode", "prefill"]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not cpp_build.available(), reason="the C++ decode kernel is not built here")
def test_with_the_cpp_kernel_prompts_up_to_its_limit_attend_as_row_queries():
    kv = PagedKVCache({0: KVCacheSpec(2, 8, torch.float32)}, 8, BS)
    assert kv.row_query_rows == ROW_QUERY_CHUNK_CPP
    out, want, calls = attend_step([1, 100, 37], [9, 100, 50], num_decodes=1, seed=3)  # two prompts, one fresh
    assert calls == ["decode"]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    out, want, calls = attend_step([1, ROW_QUERY_CHUNK_CPP + 1], [3, ROW_QUERY_CHUNK_CPP + 1], num_decodes=1, seed=4)
    assert calls == ["decode", "prefill"]
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
