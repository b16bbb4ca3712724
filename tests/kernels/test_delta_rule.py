"""The gated delta rule, one family for both decay kinds: a decay per head (Gated DeltaNet,
``g [T, H]``) and per key channel (KDA, ``g [T, H, K]``). Torch: chunked == recurrent == the decode
op, varlen == separate calls, both kinds == transformers' own functions (Qwen3-Next, Kimi Linear),
and a per-head decay == the same decay broadcast per key. Triton (under ``TRITON_INTERPRET=1`` on
CPU) == the reference on odd, varlen, strided and bf16 inputs, NaN-filled outputs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels.delta_rule import reference as ref

tri = pytest.importorskip("layerzoo.kernels.delta_rule.triton")

KINDS = ["head", "key"]
RATIO = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make(T, kind, H=2, K=16, V=24, N=1, *, seed=0, strong=False, h0=True, dtype=torch.float32, device="cpu"):
    """``(q, k, v, g, beta, initial_state)``: decays in ``(-1.5, 0)`` (``strong``: down to -20, where
    ``exp(G) * exp(-G)`` would overflow inside a chunk), per head or per key; beta in ``(0, 1)``."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, H, K, generator=gen), torch.randn(T, H, K, generator=gen)
    v = torch.randn(T, H, V, generator=gen)
    g = -(20.0 if strong else 1.5) * torch.rand(T, H, *((K,) if kind == "key" else ()), generator=gen)
    beta = torch.rand(T, H, generator=gen)
    state = 0.5 * torch.randn(N, H, K, V, generator=gen) if h0 else None
    q, k, v, g, beta = (t.to(dtype).to(device) for t in (q, k, v, g, beta))
    return q, k, v, g, beta, None if state is None else state.to(device)


def cu(lens, device="cpu"):
    return torch.tensor([0, *lens], device=device).cumsum(0)


# ---- torch references -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("T", [1, 7, 64, 65, 130])
def test_chunk_matches_recurrent(T, kind, assert_close):
    q, k, v, g, beta, h0 = make(T, kind)
    o_r, s_r = ref.recurrent_delta_rule(q, k, v, g, beta, scale=0.25, initial_state=h0)
    o_c, s_c = ref.chunk_delta_rule(q, k, v, g, beta, scale=0.25, initial_state=h0)
    assert o_c.dtype == v.dtype and s_c.dtype == torch.float32 and s_c.shape == (1, 2, 16, 24)
    assert_close("o", o_r, o_c)
    assert_close("state", s_r, s_c)


@pytest.mark.parametrize("kind", KINDS)
def test_per_head_decay_is_the_per_key_decay_broadcast(kind, assert_close):
    """The two kinds are one rule: a per-head decay gives what the same value on every key channel gives."""
    q, k, v, g, beta, h0 = make(70, "head", seed=7)
    fn = ref.chunk_delta_rule if kind == "head" else ref.recurrent_delta_rule
    o, s = fn(q, k, v, g, beta, scale=0.3, initial_state=h0)
    o_k, s_k = fn(q, k, v, g[..., None].expand(*g.shape, q.shape[-1]), beta, scale=0.3, initial_state=h0)
    assert_close("o", o, o_k)
    assert_close("state", s, s_k)


@pytest.mark.parametrize("kind", KINDS)
def test_strong_decays_stay_finite(kind, assert_close):
    q, k, v, g, beta, h0 = make(70, kind, strong=True, seed=3)
    o_r, s_r = ref.recurrent_delta_rule(q, k, v, g, beta, scale=0.25, initial_state=h0)
    o_c, s_c = ref.chunk_delta_rule(q, k, v, g, beta, scale=0.25, initial_state=h0)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    assert_close("o", o_r, o_c)


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_size_does_not_matter(chunk_size, assert_close):
    q, k, v, g, beta, h0 = make(70, "head", K=8, V=8)
    o64, s64 = ref.chunk_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=h0)
    o, s = ref.chunk_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=h0, chunk_size=chunk_size)
    assert_close("o", o64, o)
    assert_close("state", s64, s)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_varlen_equals_separate_calls(fn, kind, assert_close):
    """A varlen batch (an empty sequence included) == one call per sequence."""
    op = getattr(ref, f"{fn}_delta_rule")
    lens = [1, 0, 65, 7]
    q, k, v, g, beta, h0 = make(sum(lens), kind, N=len(lens), seed=1)
    o, s = op(q, k, v, g, beta, scale=0.25, initial_state=h0, cu_seqlens=cu(lens))
    starts = cu(lens).tolist()
    for n, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        o_n, s_n = op(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], scale=0.25, initial_state=h0[n : n + 1])
        if b > a:
            assert_close(f"o[{n}]", o_n, o[a:b])
        assert_close(f"state[{n}]", s_n[0], s[n])
    assert torch.equal(s[1], h0[1])  # the empty sequence keeps its state


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_split_prefill_carries_state(fn, assert_close):
    op = getattr(ref, f"{fn}_delta_rule")
    q, k, v, g, beta, _ = make(100, "key", seed=3, h0=False)
    o, s = op(q, k, v, g, beta, scale=0.25)
    o1, s1 = op(q[:37], k[:37], v[:37], g[:37], beta[:37], scale=0.25)
    o2, s2 = op(q[37:], k[37:], v[37:], g[37:], beta[37:], scale=0.25, initial_state=s1)
    assert_close("o", o, torch.cat([o1, o2]))
    assert_close("state", s, s2)


def test_bad_decay_shape_is_named():
    q, k, v, g, beta, _ = make(5, "head", h0=False)
    with pytest.raises(ValueError, match=r"g \[T, H\] \(per head\) or \[T, H, K\] \(per key\)"):
        ref.chunk_delta_rule(q, k, v, g[..., None], beta, scale=1.0)


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_per_head_matches_transformers_qwen3_next(use_qk_l2norm, assert_close):
    """Against transformers' Qwen3-Next torch functions: a batch of 2 sequences (our varlen), one
    key head serving two value heads (ours get the key heads repeated, as the caller does)."""
    qn = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    hf_chunk = getattr(qn.torch_chunk_gated_delta_rule, "__wrapped__", qn.torch_chunk_gated_delta_rule)
    hf_rec = getattr(qn.torch_recurrent_gated_delta_rule, "__wrapped__", qn.torch_recurrent_gated_delta_rule)
    gen = torch.Generator().manual_seed(4)
    Bsz, T, Hk, Hv, K, V = 2, 70, 1, 2, 16, 24
    q, k = torch.randn(Bsz, T, Hk, K, generator=gen), torch.randn(Bsz, T, Hk, K, generator=gen)
    if not use_qk_l2norm:  # keep ||k|| <= 1 so the unnormalised recurrence stays bounded
        q, k = F.normalize(q, dim=-1), 0.9 * F.normalize(k, dim=-1)
    v = torch.randn(Bsz, T, Hv, V, generator=gen)
    g = -torch.rand(Bsz, T, Hv, generator=gen)
    beta = torch.rand(Bsz, T, Hv, generator=gen)
    h0 = torch.randn(Bsz, Hv, K, V, generator=gen)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=use_qk_l2norm)
    o_hf, s_hf = hf_chunk(q, k, v, g, beta, chunk_size=64, **kw)
    o_hf_r, s_hf_r = hf_rec(q, k, v, g, beta, **kw)

    def flat(t, heads=None):  # [B, T, H, ...] -> [B*T, H, ...], key heads repeated to Hv
        t = t if heads is None else t.repeat_interleave(heads, dim=2)
        return t.reshape(Bsz * T, *t.shape[2:])

    args = (flat(q, Hv // Hk), flat(k, Hv // Hk), flat(v), flat(g), flat(beta))
    kw = dict(scale=K**-0.5, initial_state=h0, cu_seqlens=cu([T] * Bsz), use_qk_l2norm=use_qk_l2norm)
    for name, op in (("chunk", ref.chunk_delta_rule), ("recurrent", ref.recurrent_delta_rule)):
        o, s = op(*args, **kw)
        assert_close(f"{name} o vs hf chunk", flat(o_hf), o)
        assert_close(f"{name} state vs hf chunk", s_hf, s)
        assert_close(f"{name} o vs hf recurrent", flat(o_hf_r), o)
        assert_close(f"{name} state vs hf recurrent", s_hf_r, s)


@pytest.mark.parametrize("T", [5, 70])
def test_per_key_matches_transformers_kimi_linear(T, assert_close):
    kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
    q, k, v, g, beta, h0 = make(T, "key", K=16, V=16, seed=4)
    K = q.shape[-1]
    batch = lambda t: t[None]  # noqa: E731 - transformers takes [B, T, H, ...]
    pairs = ((ref.chunk_delta_rule, kimi.chunk_kimi_delta_attention), (ref.recurrent_delta_rule, kimi.recurrent_kimi_delta_attention))
    for ours, theirs in pairs:
        o, s = ours(q, k, v, g, beta, scale=K**-0.5, initial_state=h0)
        o_tf, s_tf = theirs(batch(q), batch(k), batch(v), g=batch(g), beta=batch(beta), initial_state=h0.clone(),
                            output_final_state=True, use_qk_l2norm_in_kernel=True)
        assert_close(f"{ours.__name__} o", o_tf[0], o)
        assert_close(f"{ours.__name__} state", s_tf, s)


# ---- the decode op: one token per sequence, states in the pool updated in place ----------------


def _pool_case(kind, device="cpu", N=4, P=7, seed=5):
    q, k, v, g, beta, _ = make(N, kind, H=3, K=12, V=20, seed=seed, device=device)
    pool = torch.randn(P, 3, 12, 20, generator=torch.Generator().manual_seed(seed + 1)).to(device)
    slots = torch.tensor([5, 0, 3, 6][:N], device=device)
    return (q, k, v, g, beta), pool, slots


@pytest.mark.parametrize("kind", KINDS)
def test_decode_op_equals_the_recurrent_op_over_one_token_each(kind, assert_close):
    args, pool, slots = _pool_case(kind)
    o_r, s_r = ref.recurrent_delta_rule(*args, scale=0.3, initial_state=pool[slots], cu_seqlens=cu([1] * 4))
    before = pool.clone()
    o = ref.delta_rule_decode(*args, scale=0.3, state=pool, slots=slots)
    assert o.shape == (4, 3, 20)
    assert_close("o", o_r, o, 1e-6)
    assert_close("state", s_r, pool[slots], 1e-6)
    untouched = [i for i in range(pool.shape[0]) if i not in slots.tolist()]
    assert torch.equal(pool[untouched], before[untouched])


def test_decode_op_traces_whole():
    """Compiled as one graph (``fullgraph``): it reads nothing on the host, unlike the varlen op."""
    args, pool, slots = _pool_case("key", N=3)
    expected_pool = pool.clone()
    expected = ref.delta_rule_decode(*args, scale=0.3, state=expected_pool, slots=slots)
    decode = torch.compile(ref.delta_rule_decode, backend="eager", fullgraph=True, dynamic=False)
    torch.testing.assert_close(decode(*args, scale=0.3, state=pool, slots=slots), expected)
    torch.testing.assert_close(pool, expected_pool)
    varlen = torch.compile(ref.recurrent_delta_rule, backend="eager", fullgraph=True, dynamic=False)
    with pytest.raises(Exception):
        varlen(*args, scale=0.3, initial_state=pool[slots], cu_seqlens=cu([1] * 3))


@pytest.mark.parametrize("kind", KINDS)
def test_triton_decode_matches_reference(kind, device, nan_empty, assert_close):
    args, pool, slots = _pool_case(kind, device)
    pool_ref = pool.clone()
    o_ref = ref.delta_rule_decode(*args, scale=0.25, state=pool_ref, slots=slots)
    o = tri.delta_rule_decode(*args, scale=0.25, state=pool, slots=slots)
    assert_close("o", o_ref, o)
    assert_close("pool", pool_ref, pool)


# ---- Triton == reference ----------------------------------------------------------------------

TRITON_CASES = [  # (lens or None for one sequence, K, V, dtype, initial state, l2norm)
    ([1, 8, 20], 16, 32, torch.float32, True, True),
    (None, 12, 40, torch.float32, False, False),  # odd dims, two value blocks, no l2norm
    ([1, 0, 20, 5], 12, 10, torch.float32, True, True),  # an empty sequence, odd dims
    ([0, 5, 9], 16, 32, torch.bfloat16, True, True),
]


def _case_id(case):
    lens, K, V, dtype, h0, l2 = case
    return f"{'x'.join(map(str, lens)) if lens else 'single'}-K{K}-V{V}-{str(dtype)[6:]}-h0{int(h0)}-l2{int(l2)}"


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
@pytest.mark.parametrize("case", TRITON_CASES, ids=_case_id)
def test_triton_matches_reference(case, fn, kind, device, nan_empty, assert_close):
    lens, K, V, dtype, has_h0, l2 = case
    T = sum(lens) if lens else 23
    q, k, v, g, beta, h0 = make(T, kind, K=K, V=V, N=len(lens) if lens else 1, dtype=dtype, device=device, h0=has_h0, seed=5)
    kw = dict(scale=K**-0.5, initial_state=h0, cu_seqlens=cu(lens, device) if lens else None, use_qk_l2norm=l2)
    o, s = getattr(tri, f"{fn}_delta_rule")(q, k, v, g, beta, **kw)
    o_ref, s_ref = getattr(ref, f"{fn}_delta_rule")(q, k, v, g, beta, **kw)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_close("o", o_ref, o, RATIO[dtype])
    assert_close("state", s_ref, s, RATIO[dtype])


@pytest.mark.parametrize("kind", KINDS)
def test_triton_chunk_crosses_chunks(kind, device, nan_empty, assert_close):
    """Longer than the kernel's chunk (64 per head, 16 per key) with a ragged tail."""
    lens = [66, 3] if kind == "head" else [35, 3]
    q, k, v, g, beta, h0 = make(sum(lens), kind, K=16, V=16, N=2, device=device, seed=8)
    kw = dict(scale=0.25, initial_state=h0, cu_seqlens=cu(lens, device))
    o, s = tri.chunk_delta_rule(q, k, v, g, beta, **kw)
    o_ref, s_ref = ref.chunk_delta_rule(q, k, v, g, beta, **kw)
    assert_close("o", o_ref, o)
    assert_close("state", s_ref, s)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_triton_strong_decays_strided_inputs_and_split_prefill(fn, kind, device, nan_empty, assert_close):
    """q, k, v and g, beta as views of fused projections, strong decays; two calls with the state
    carried == one call."""
    op, op_ref = getattr(tri, f"{fn}_delta_rule"), getattr(ref, f"{fn}_delta_rule")
    T, H, K, V = 21, 2, 16, 16
    gen = torch.Generator().manual_seed(6)
    qkv = torch.randn(T, H, 2 * K + V, generator=gen).to(device)
    q, k, v = qkv[..., :K], qkv[..., K : 2 * K], qkv[..., 2 * K :]
    gk = K if kind == "key" else 1
    gb = torch.rand(T, H, gk + 1, generator=gen).to(device)
    g = -20.0 * (gb[..., :K] if kind == "key" else gb[..., 0])
    beta = gb[..., -1]
    o_ref, s_ref = op_ref(q, k, v, g, beta, scale=0.25)
    o1, s1 = op(q[:11], k[:11], v[:11], g[:11], beta[:11], scale=0.25)
    o2, s2 = op(q[11:], k[11:], v[11:], g[11:], beta[11:], scale=0.25, initial_state=s1)
    assert torch.isfinite(o2).all()
    assert_close("o", o_ref, torch.cat([o1, o2]))
    assert_close("state", s_ref, s2)


def test_triton_unsupported_inputs_fall_back(device):
    q, k, v, g, beta, _ = make(3, "head", K=300, V=4, h0=False, device=device)
    with pytest.raises(KernelUnsupported, match="K <= 256"):
        tri.chunk_delta_rule(q, k, v, g, beta, scale=1.0)
    q, k, v, g, beta, _ = make(3, "key", h0=False, dtype=torch.float64, device=device)
    with pytest.raises(KernelUnsupported, match="fp32/fp16/bf16"):
        tri.recurrent_delta_rule(q, k, v, g, beta, scale=1.0)


# ---- registration -----------------------------------------------------------------------------


def test_ops_are_registered():
    """Each op of the family resolves to a torch and a Triton function of the one folder."""
    from layerzoo.kernels import OPS, backends_of
    from layerzoo.plugins.manager import resolve_object

    for op in ("delta_rule_chunk", "delta_rule_recurrent", "delta_rule_decode"):
        assert OPS[op][0] == "delta_rule"
        backends = backends_of(op)
        assert set(backends) == {"torch", "triton"}
        for target in backends.values():
            assert callable(resolve_object(target))


def test_kernel_op_falls_back_to_reference(device, assert_close):
    """Through the registry's `KernelOp` with the Triton backend forced: a key dim the kernel does
    not hold (K > 256) runs the torch reference instead, with the same result."""
    from layerzoo.kernels import backends_of
    from layerzoo.plugins.kernel_registry import KernelOp

    op = KernelOp("delta_rule_recurrent", backends_of("delta_rule_recurrent"), env={"LAYERZOO_KERNEL_BACKEND": "triton"})
    q, k, v, g, beta, _ = make(3, "key", K=300, V=4, h0=False, device=device)
    o, s = op(q, k, v, g, beta, scale=0.1)
    o_ref, s_ref = ref.recurrent_delta_rule(q, k, v, g, beta, scale=0.1)
    assert_close("o", o_ref, o)
    assert_close("state", s_ref, s)
    assert len(op.fallbacks) == 1
