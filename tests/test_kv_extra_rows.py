"""KVCacheSpec.extra_rows: per-token rows of other widths beside a layer's own (a DSA indexer's
key next to an MLA latent), sized in the budget, paged under the same block tables."""

import pytest
import torch

from layerzoo.layers.context import ForwardContext
from layerzoo.layers.kv_cache import KVCacheSpec
from layerzoo.runtime.kv_pool import PagedKVCache, num_blocks_for_budget, with_kv_cache_dtype


def spec():
    """An MLA layer's latent of 12 + 4 and a 6-wide indexer key."""
    return KVCacheSpec(1, 16, torch.float32, rows=("latent",), extra_rows=(("index_k", 6),))


def test_extra_rows_count_in_the_footprint_in_the_compute_dtype():
    s = spec()
    assert s.is_latent and s.bytes_per_token == 4 * (16 + 6)
    fp8 = with_kv_cache_dtype({0: s}, "fp8")[0]
    assert fp8.bytes_per_token == 16 * 1 + 6 * 4  # the latent in e4m3, the extra row stays fp32
    assert num_blocks_for_budget({0: s}, 4, 4 * 4 * 22 * 3) == 3


def test_names_must_not_clash():
    with pytest.raises(AssertionError):
        KVCacheSpec(1, 16, torch.float32, rows=("latent",), extra_rows=(("latent", 6),))


@pytest.mark.parametrize("scratch", [False, True])
def test_write_row_lands_at_the_slots_and_reads_back_paged(scratch):
    kv = PagedKVCache({0: spec()}, num_blocks=3, block_size=4, pad_block=scratch)
    row = kv.row(0, "index_k")
    assert row.shape == (3 + scratch, 4, 1, 6) and row.dtype == torch.float32
    ctx = ForwardContext.for_paged(seq_ids=[0], query_lens=[6], context_lens=[6], block_tables=[[2, 0]],
                                   block_size=4, num_decodes=0, kv_cache=kv)
    x = torch.randn(6, 1, 6)
    kv.write_row(0, "index_k", x, ctx)
    paged = kv.row(0, "index_k")[torch.tensor([2, 0])].reshape(-1, 6)[:6]
    assert torch.equal(paged, x[:, 0])
    with pytest.raises(AssertionError, match="no extra row"):
        kv.write_row(0, "latent", x, ctx)
