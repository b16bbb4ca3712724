"""Kimi Delta Attention: chunked == recurrent (torch), both == transformers' Kimi Linear functions,
and the Triton kernels == the references on odd, varlen and strided inputs (NaN-filled outputs)."""

from __future__ import annotations

import pytest
import torch

from layerzoo.kernels.kda import reference as ref
from layerzoo.testing import assert_close

tri = pytest.importorskip("layerzoo.kernels.kda.triton")


def make(T, H=2, K=16, V=24, N=1, *, seed=0, strong=False, h0=True):
    """``(q, k, v, g, beta, initial_state)`` with per-channel decays in ``(-1.5, 0)`` (``strong``:
    down to -20, where ``exp(G) * exp(-G)`` would overflow inside a chunk) and beta in ``(0, 1)``."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, H, K, generator=gen), torch.randn(T, H, K, generator=gen)
    v = torch.randn(T, H, V, generator=gen)
    g = -(20.0 if strong else 1.5) * torch.rand(T, H, K, generator=gen)
    beta = torch.rand(T, H, generator=gen)
    state = 0.5 * torch.randn(N, H, K, V, generator=gen) if h0 else None
    return q, k, v, g, beta, state


def cu(lens):
    return torch.tensor([0, *lens]).cumsum(0)


# ---- torch references -------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 7, 64, 65, 130])
def test_chunk_matches_recurrent(T):
    q, k, v, g, beta, h0 = make(T)
    o_r, s_r = ref.recurrent_kda(q, k, v, g, beta, scale=0.25, initial_state=h0)
    o_c, s_c = ref.chunk_kda(q, k, v, g, beta, scale=0.25, initial_state=h0)
    assert o_c.dtype == v.dtype and s_c.dtype == torch.float32 and s_c.shape == (1, 2, 16, 24)
    assert_close("o", o_r, o_c, 1e-5)
    assert_close("state", s_r, s_c, 1e-5)


def test_strong_decays_stay_finite():
    q, k, v, g, beta, h0 = make(70, strong=True, seed=3)
    o_r, s_r = ref.recurrent_kda(q, k, v, g, beta, scale=0.25, initial_state=h0)
    o_c, s_c = ref.chunk_kda(q, k, v, g, beta, scale=0.25, initial_state=h0)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    assert_close("o", o_r, o_c, 1e-5)


@pytest.mark.parametrize("fn", ["chunk_kda", "recurrent_kda"])
def test_varlen_equals_separate_calls(fn):
    """A varlen batch (an empty sequence included) == one call per sequence."""
    op = getattr(ref, fn)
    lens = [1, 0, 65, 7]
    q, k, v, g, beta, h0 = make(sum(lens), N=len(lens), seed=1)
    o, s = op(q, k, v, g, beta, scale=0.25, initial_state=h0, cu_seqlens=cu(lens))
    starts = cu(lens).tolist()
    for n, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        o_n, s_n = op(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], scale=0.25, initial_state=h0[n : n + 1])
        if b > a:
            assert_close(f"o[{n}]", o_n, o[a:b])
        assert_close(f"state[{n}]", s_n[0], s[n])
    assert torch.equal(s[1], h0[1])


@pytest.mark.parametrize("T", [5, 70])
def test_references_match_transformers(T):
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, g, beta, h0 = make(T, K=16, V=16, seed=4)
    K = q.shape[-1]
    batch = lambda t: t[None]  # noqa: E731 - transformers takes [B, T, H, ...]
    for ours, theirs in ((ref.chunk_kda, kimi.chunk_kimi_delta_attention), (ref.recurrent_kda, kimi.recurrent_kimi_delta_attention)):
        o, s = ours(q, k, v, g, beta, scale=K**-0.5, initial_state=h0)
        o_tf, s_tf = theirs(batch(q), batch(k), batch(v), g=batch(g), beta=batch(beta), initial_state=h0.clone(),
                            output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert_close(f"{ours.__name__} o", o_tf[0], o, 1e-5)
        assert_close(f"{ours.__name__} state", s_tf, s, 1e-5)


# ---- Triton == reference ----------------------------------------------------------------------


@pytest.mark.parametrize("fn", ["chunk_kda", "recurrent_kda"])
@pytest.mark.parametrize("lens,K,V", [([37], 16, 24), ([1, 0, 20, 5], 12, 10)])
def test_triton_matches_reference(fn, lens, K, V, nan_empty):
    q, k, v, g, beta, h0 = make(sum(lens), K=K, V=V, N=len(lens), seed=5)
    cus = cu(lens) if len(lens) > 1 else None
    o_ref, s_ref = getattr(ref, fn)(q, k, v, g, beta, scale=0.3, initial_state=h0, cu_seqlens=cus)
    o, s = getattr(tri, fn)(q, k, v, g, beta, scale=0.3, initial_state=h0, cu_seqlens=cus)
    assert_close("o", o_ref, o, 1e-5)
    assert_close("state", s_ref, s, 1e-5)


def test_triton_chunk_strong_decays_and_strided_rows(nan_empty):
    q, k, v, g, beta, h0 = make(21, strong=True, seed=6)
    qkv = torch.cat([q, k, v[..., :16]], dim=-1)  # q, k as strided views of a fused tensor
    q, k = qkv[..., :16], qkv[..., 16:32]
    o_ref, s_ref = ref.chunk_kda(q, k, v, g, beta, scale=0.25, initial_state=None)
    o, s = tri.chunk_kda(q, k, v, g, beta, scale=0.25, initial_state=None)
    assert torch.isfinite(o).all()
    assert_close("o", o_ref, o, 1e-5)
    assert_close("state", s_ref, s, 1e-5)


def test_ops_are_registered():
    from layerzoo.kernels import backends_of

    for op in ("kda_chunk", "kda_recurrent", "causal_conv1d", "causal_conv1d_update"):
        assert set(backends_of(op)) == {"torch", "triton"}
