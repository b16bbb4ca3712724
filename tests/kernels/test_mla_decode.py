"""The absorbed MLA decode reads the latent cache through the shared paged decode op: one KV
"head" whose keys and values are the same tensor ``[N, block, 1, kv_lora_rank + rope_dim]``.
The Triton kernel serves that layout as the reference does (ragged contexts, shuffled blocks)."""

from __future__ import annotations

import pytest
import torch

from layerzoo.kernels.paged_attention import reference
from layerzoo.testing import assert_close

tri = pytest.importorskip("layerzoo.kernels.paged_attention.triton")


@pytest.mark.parametrize("H,D", [(3, 20), (4, 48)])
def test_triton_decode_over_latents_matches_the_reference(H, D, nan_empty):
    gen = torch.Generator().manual_seed(D)
    lens, block = [1, 13, 7], 4
    blocks = sum(-(-n // block) for n in lens)
    latent = torch.randn(blocks, block, 1, D, generator=gen)
    ids = torch.randperm(blocks, generator=gen)
    tables, first = torch.zeros(len(lens), 4, dtype=torch.long), 0
    for b, n in enumerate(lens):
        used = -(-n // block)
        tables[b, :used] = ids[first : first + used]
        first += used
    q = torch.randn(len(lens), H, D, generator=gen)
    context = torch.tensor(lens)
    expected = reference.paged_decode_attention(q, latent, latent, tables, context, 0.3)
    assert_close("o", expected, tri.paged_decode_attention(q, latent, latent, tables, context, 0.3))
