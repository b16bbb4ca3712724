"""The kpool_compress and mhc_sinkhorn ops: Triton (under TRITON_INTERPRET=1 on CPU) against the
torch references on ragged shapes, and the references against transformers' GLM-5.3-Flash code."""

import pytest
import torch

from layerzoo import testing
from layerzoo_glm53.ops.kpool_compress import reference as kpool_ref
from layerzoo_glm53.ops.mhc_sinkhorn import reference as mhc_ref

kpool_tri = pytest.importorskip("layerzoo_glm53.ops.kpool_compress.triton")
mhc_tri = pytest.importorskip("layerzoo_glm53.ops.mhc_sinkhorn.triton")


def kpool_inputs(P, k, D, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    keys, gates = torch.randn(P, k, D, generator=g), torch.randn(P, k, D, generator=g) * 3
    ape = torch.randn(k, D, generator=g)
    counts = torch.randint(0, k + 1, (P,), generator=g)
    counts[0] = k  # at least one complete pool
    return [t.to(device) for t in (keys, gates, ape, counts)]


# (P, k, D): odd pool sizes and widths, one pool, a width past one 128-channel block
@pytest.mark.parametrize("P,k,D", [(1, 1, 3), (5, 3, 17), (7, 4, 16), (3, 5, 130)])
def test_kpool_triton_matches_the_reference(P, k, D):
    keys, gates, ape, counts = kpool_inputs(P, k, D, testing.kernel_test_device())
    ref = kpool_ref.kpool_compress(keys, gates, ape, counts)
    torch.testing.assert_close(kpool_tri.kpool_compress(keys, gates, ape, counts), ref, atol=1e-5, rtol=1e-5)


def test_kpool_counts_ignore_the_unwritten_slots():
    """A pool's key depends only on its first ``count`` slots; an empty pool is zeros."""
    keys, gates, ape, _ = kpool_inputs(3, 4, 8, "cpu")
    counts = torch.tensor([2, 0, 4])
    out = kpool_ref.kpool_compress(keys, gates, ape, counts)
    changed = keys.clone()
    changed[0, 2:] = 100.0
    assert torch.equal(kpool_ref.kpool_compress(changed, gates, ape, counts)[0], out[0])
    assert torch.equal(out[1], torch.zeros(8))
    two = kpool_ref.kpool_compress(keys[:1, :2], gates[:1, :2], ape[:2], torch.tensor([2]))
    torch.testing.assert_close(out[0], two[0])


def test_kpool_reference_is_transformers_pooling():
    """Against ``Glm5NextTextIndexer.get_pooled_states`` on one sequence of 11 tokens (pools of 4)."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    config = transformers.Glm5NextTextConfig(hidden_size=16, index_head_dim=8, index_kpool=4, index_topk=8, q_lora_rank=8)
    indexer = Glm5NextTextIndexer(config, 0)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        indexer.index_kpool_compress_ape.copy_(torch.randn(4, 8, generator=g))
    keys, gates = torch.randn(1, 11, 8, generator=g), torch.randn(1, 11, 8, generator=g)
    packed = torch.cat([keys, gates, torch.ones(1, 11, 1)], dim=-1)
    expected, _, valid = indexer.get_pooled_states(packed)
    assert valid.tolist() == [[True, True]]  # the tail pool of 3 is not a candidate
    padded = torch.cat([keys, torch.zeros(1, 1, 8)], 1).view(3, 4, 8), torch.cat([gates, torch.zeros(1, 1, 8)], 1).view(3, 4, 8)
    ours = kpool_ref.kpool_compress(*padded, indexer.index_kpool_compress_ape.detach(), torch.tensor([4, 4, 3]))
    torch.testing.assert_close(ours[:2], expected[0])


def mhc_inputs(T, N, D, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    M = (2 + N) * N
    mixes, base = torch.randn(T, M, generator=g), torch.randn(M, generator=g)
    scale = torch.rand(3, generator=g) + 0.5
    streams = torch.randn(T, N, D, generator=g).to(dtype)
    return [t.to(device) for t in (mixes, base, scale, streams)]


# (T, N, D): one token, odd stream counts and widths, a width past one 256-channel block
@pytest.mark.parametrize("T,N,D", [(1, 1, 5), (3, 3, 17), (6, 4, 32), (2, 5, 300)])
def test_mhc_triton_matches_the_reference(T, N, D):
    mixes, base, scale, streams = mhc_inputs(T, N, D, testing.kernel_test_device())
    ref = mhc_ref.mhc_sinkhorn(mixes, base, scale, streams, 1e-6, 20)
    out = mhc_tri.mhc_sinkhorn(mixes, base, scale, streams, 1e-6, 20)
    for got, want in zip(out, ref):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_mhc_comb_is_doubly_stochastic_and_bf16_streams_collapse_in_their_dtype():
    mixes, base, scale, streams = mhc_inputs(4, 4, 8, "cpu", dtype=torch.bfloat16)
    post, comb, collapsed = mhc_ref.mhc_sinkhorn(mixes, base, scale, streams, 1e-6, 20)
    torch.testing.assert_close(comb.sum(-2), torch.ones(4, 4), atol=1e-4, rtol=0)
    torch.testing.assert_close(comb.sum(-1), torch.ones(4, 4), atol=1e-3, rtol=0)
    assert collapsed.dtype == torch.bfloat16 and post.dtype == comb.dtype == torch.float32
    assert ((post > 0) & (post < 2)).all()
    _, _, tri_collapsed = mhc_tri.mhc_sinkhorn(mixes, base, scale, streams, 1e-6, 20)
    torch.testing.assert_close(tri_collapsed.float(), collapsed.float(), atol=2e-2, rtol=1e-2)


def test_mhc_reference_is_transformers_hyper_connection():
    transformers = pytest.importorskip("transformers")
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextHyperConnection

    config = transformers.Glm5NextTextConfig(hidden_size=12, hc_mult=3, q_lora_rank=8)
    hc = Glm5NextTextHyperConnection(config)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for p in hc.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    streams = torch.randn(2, 5, 3, 12, generator=g)
    post, comb, collapsed = hc(streams)
    flat = streams.view(10, 36).float()
    mixes = torch.nn.functional.linear(flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + config.rms_norm_eps), hc.fn.float())
    ours = mhc_ref.mhc_sinkhorn(mixes, hc.base.detach(), hc.scale.detach(), streams.view(10, 3, 12), config.hc_eps, config.hc_sinkhorn_iters)
    for got, want in zip(ours, (post.view(10, 3), comb.view(10, 3, 3), collapsed.view(10, 12))):
        torch.testing.assert_close(got, want.detach(), atol=1e-6, rtol=1e-5)


def test_the_plugin_registers_both_backends_of_each():
    from layerzoo.plugins.kernel_registry import kernels_report
    from layerzoo.plugins.manager import get_registry

    rows = {r["op"]: r for r in kernels_report(get_registry(), "cuda")}
    for op in ("kpool_compress", "mhc_sinkhorn"):
        assert rows[op]["backends"] == {"torch": "glm53", "triton": "glm53"}
