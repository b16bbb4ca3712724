"""KVCacheSpec.pooled_rows: rows kept once per k tokens (a k-pool indexer's pooled key), sized in
the budget, paged under the same block tables as the layer's per-token rows."""

import pytest
import torch

from layerzoo.errors import UserError
from layerzoo.layers.kv_cache import KVCacheSpec
from layerzoo.runtime.kv_pool import PagedKVCache, num_blocks_for_budget, with_kv_cache_dtype


def spec(k=4):
    """An MLA latent of 16, a 6-wide per-token indexer key and a 6-wide pooled key per k tokens."""
    return KVCacheSpec(1, 16, torch.float32, rows=("latent",), extra_rows=(("index_k", 6),), pooled_rows=(("index_pool", 6, k),))


def test_pooled_rows_count_once_per_k_tokens_in_the_compute_dtype():
    s = spec()
    assert s.bytes_per_token == 4 * (16 + 6) + 4 * 6 // 4
    assert spec(k=5).bytes_per_token == 4 * (16 + 6) + 5  # 24 bytes over 5 tokens, rounded up
    fp8 = with_kv_cache_dtype({0: s}, "fp8")[0]
    assert fp8.bytes_per_token == 16 + 6 * 4 + 6  # only the latent in e4m3
    assert num_blocks_for_budget({0: s}, 4, (4 * 22 + 6) * 4 * 3) == 3


def test_names_must_not_clash():
    with pytest.raises(AssertionError):
        KVCacheSpec(1, 16, torch.float32, rows=("latent",), extra_rows=(("p", 6),), pooled_rows=(("p", 6, 4),))


def test_block_size_must_be_a_multiple_of_k():
    with pytest.raises(UserError, match="block_size: layer 3 keeps one 'index_pool' row per 4 tokens"):
        PagedKVCache({3: spec()}, num_blocks=2, block_size=6)
    spec().check_block_size(8)


@pytest.mark.parametrize("scratch", [False, True])
def test_pooled_rows_are_paged_one_row_per_k_tokens(scratch):
    kv = PagedKVCache({0: spec()}, num_blocks=3, block_size=8, pad_block=scratch)
    pooled = kv.pooled_row(0, "index_pool")
    assert pooled.shape == (3 + scratch, 2, 1, 6) and pooled.dtype == torch.float32
    # pool j of a sequence with table [2, 0]: block table[j // 2], offset j % 2
    table = torch.tensor([2, 0])
    pools = torch.arange(4)
    slots = table[pools // 2] * 2 + pools % 2
    x = torch.randn(4, 1, 6)
    kv.write_pooled_row(0, "index_pool", x, slots)
    assert torch.equal(pooled[table].reshape(-1, 6), x[:, 0])
    with pytest.raises(AssertionError, match="no pooled row"):
        kv.pooled_row(0, "index_k")
