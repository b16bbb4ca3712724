"""Gated delta rule: chunked == recurrent (torch), both == transformers' Qwen3-Next functions, and
the Triton kernels == the references on odd, varlen and strided inputs (NaN-filled outputs)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from layerzoo.errors import KernelUnsupported
from layerzoo_ssm.ops.gated_delta_rule import reference as ref

tri = pytest.importorskip("layerzoo_ssm.ops.gated_delta_rule.triton")

RATIO = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make(T, H=2, K=16, V=32, N=1, *, seed=0, dtype=torch.float32, device="cpu", h0=True):
    """``(q, k, v, g, beta, initial_state)`` with decays in ``(-1.5, 0)`` and ``beta`` in ``(0, 1)``."""
    gen = torch.Generator().manual_seed(seed)
    q, k = torch.randn(T, H, K, generator=gen), torch.randn(T, H, K, generator=gen)
    v = torch.randn(T, H, V, generator=gen)
    g = -1.5 * torch.rand(T, H, generator=gen)
    beta = torch.rand(T, H, generator=gen)
    state = 0.5 * torch.randn(N, H, K, V, generator=gen) if h0 else None
    q, k, v, g, beta = (t.to(dtype).to(device) for t in (q, k, v, g, beta))
    return q, k, v, g, beta, None if state is None else state.to(device)


def cu(lens, device="cpu"):
    return torch.tensor([0, *lens], device=device).cumsum(0)


# ---- torch references -------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 130])
def test_chunk_matches_recurrent(T, assert_close):
    q, k, v, g, beta, h0 = make(T)
    o_r, s_r = ref.recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.25, initial_state=h0)
    o_c, s_c = ref.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.25, initial_state=h0)
    assert o_c.dtype == v.dtype and s_c.dtype == torch.float32 and s_c.shape == (1, 2, 16, 32)
    assert_close("o", o_r, o_c, 1e-5)
    assert_close("state", s_r, s_c, 1e-5)


@pytest.mark.parametrize("chunk_size", [16, 32])
def test_chunk_size_does_not_matter(chunk_size, assert_close):
    q, k, v, g, beta, h0 = make(70, K=8, V=8)
    o64, s64 = ref.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=h0)
    o, s = ref.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=h0, chunk_size=chunk_size)
    assert_close("o", o64, o)
    assert_close("state", s64, s)


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_varlen_equals_separate_calls(fn, assert_close):
    """A varlen batch (an empty sequence included) == one call per sequence."""
    op = getattr(ref, f"{fn}_gated_delta_rule")
    lens = [1, 0, 65, 7, 63]
    q, k, v, g, beta, h0 = make(sum(lens), N=len(lens), seed=1)
    o, s = op(q, k, v, g, beta, scale=0.25, initial_state=h0, cu_seqlens=cu(lens))
    starts = cu(lens).tolist()
    for n, (a, b) in enumerate(zip(starts[:-1], starts[1:])):
        o_n, s_n = op(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], scale=0.25, initial_state=h0[n : n + 1])
        if b > a:
            assert_close(f"o[{n}]", o_n, o[a:b])
        assert_close(f"state[{n}]", s_n[0], s[n])
    assert torch.equal(s[1], h0[1])  # the empty sequence keeps its state


def test_varlen_chunk_matches_recurrent(assert_close):
    lens = [1, 8, 63, 64, 65]
    q, k, v, g, beta, h0 = make(sum(lens), N=len(lens), seed=2)
    o_r, s_r = ref.recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.25, initial_state=h0, cu_seqlens=cu(lens))
    o_c, s_c = ref.chunk_gated_delta_rule(q, k, v, g, beta, scale=0.25, initial_state=h0, cu_seqlens=cu(lens))
    assert_close("o", o_r, o_c)
    assert_close("state", s_r, s_c)


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_split_prefill_carries_state(fn, assert_close):
    op = getattr(ref, f"{fn}_gated_delta_rule")
    q, k, v, g, beta, _ = make(100, seed=3, h0=False)
    o, s = op(q, k, v, g, beta, scale=0.25)
    o1, s1 = op(q[:37], k[:37], v[:37], g[:37], beta[:37], scale=0.25)
    o2, s2 = op(q[37:], k[37:], v[37:], g[37:], beta[37:], scale=0.25, initial_state=s1)
    assert_close("o", o, torch.cat([o1, o2]))
    assert_close("state", s, s2)


@pytest.mark.parametrize("use_qk_l2norm", [True, False])
def test_references_match_transformers(use_qk_l2norm, assert_close):
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
    for name, op in (("chunk", ref.chunk_gated_delta_rule), ("recurrent", ref.recurrent_gated_delta_rule)):
        o, s = op(*args, **kw)
        assert_close(f"{name} o vs hf chunk", flat(o_hf), o, 1e-5)
        assert_close(f"{name} state vs hf chunk", s_hf, s, 1e-5)
        assert_close(f"{name} o vs hf recurrent", flat(o_hf_r), o, 1e-5)
        assert_close(f"{name} state vs hf recurrent", s_hf_r, s, 1e-5)


# ---- Triton -----------------------------------------------------------------------------------

TRITON_CASES = [  # (lens or None for one sequence, K, V, dtype, initial state, l2norm)
    ([1, 8, 40], 16, 32, torch.float32, True, True),
    (None, 12, 40, torch.float32, False, False),  # odd dims, two value blocks, no l2norm
    ([1, 1, 1, 1, 1], 16, 16, torch.float32, True, True),  # decode: cu_seqlens = arange
    ([0, 5, 21], 16, 32, torch.bfloat16, True, True),  # an empty sequence
]


def _case_id(case):
    lens, K, V, dtype, h0, l2 = case
    return f"{'x'.join(map(str, lens)) if lens else 'single'}-K{K}-V{V}-{str(dtype)[6:]}-h0{int(h0)}-l2{int(l2)}"


@pytest.mark.parametrize("case", TRITON_CASES, ids=_case_id)
def test_triton_recurrent_matches_reference(case, device, nan_empty, assert_close):
    lens, K, V, dtype, has_h0, l2 = case
    T = sum(lens) if lens else 23
    q, k, v, g, beta, h0 = make(T, K=K, V=V, N=len(lens) if lens else 1, dtype=dtype, device=device, h0=has_h0)
    kw = dict(scale=K**-0.5, initial_state=h0, cu_seqlens=cu(lens, device) if lens else None, use_qk_l2norm=l2)
    o, s = tri.recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    o_ref, s_ref = ref.recurrent_gated_delta_rule(q, k, v, g, beta, **kw)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_close("o", o_ref, o, RATIO[dtype])
    assert_close("state", s_ref, s, RATIO[dtype])


CHUNK_CASES = [
    ([1, 66, 40], 16, 32, torch.float32, True, True),  # crosses a 64-token chunk
    (None, 12, 40, torch.float32, False, False),
    ([0, 30], 16, 16, torch.bfloat16, True, True),
]


@pytest.mark.parametrize("case", CHUNK_CASES, ids=_case_id)
def test_triton_chunk_matches_reference(case, device, nan_empty, assert_close):
    lens, K, V, dtype, has_h0, l2 = case
    T = sum(lens) if lens else 70
    q, k, v, g, beta, h0 = make(T, K=K, V=V, N=len(lens) if lens else 1, dtype=dtype, device=device, h0=has_h0, seed=5)
    kw = dict(scale=K**-0.5, initial_state=h0, cu_seqlens=cu(lens, device) if lens else None, use_qk_l2norm=l2)
    o, s = tri.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    o_ref, s_ref = ref.chunk_gated_delta_rule(q, k, v, g, beta, **kw)
    assert o.dtype == dtype and s.dtype == torch.float32
    assert_close("o", o_ref, o, RATIO[dtype])
    assert_close("state", s_ref, s, RATIO[dtype])


@pytest.mark.parametrize("fn", ["chunk", "recurrent"])
def test_triton_strided_inputs_and_split_prefill(fn, device, nan_empty, assert_close):
    """q, k, v as views of one fused projection; two calls with the state carried == one call."""
    op, op_ref = getattr(tri, f"{fn}_gated_delta_rule"), getattr(ref, f"{fn}_gated_delta_rule")
    T, H, K, V = 30, 2, 16, 16
    gen = torch.Generator().manual_seed(6)
    qkv = torch.randn(T, H, 2 * K + V, generator=gen).to(device)
    q, k, v = qkv[..., :K], qkv[..., K : 2 * K], qkv[..., 2 * K :]
    gb = torch.rand(T, 2 * H, generator=gen).to(device)
    g, beta = -gb[:, :H], gb[:, H:]
    o_ref, s_ref = op_ref(q, k, v, g, beta, scale=0.25)
    o1, s1 = op(q[:11], k[:11], v[:11], g[:11], beta[:11], scale=0.25)
    o2, s2 = op(q[11:], k[11:], v[11:], g[11:], beta[11:], scale=0.25, initial_state=s1)
    assert_close("o", o_ref, torch.cat([o1, o2]))
    assert_close("state", s_ref, s2)


def test_triton_unsupported_inputs_fall_back(device):
    q, k, v, g, beta, _ = make(3, K=300, V=4, h0=False, device=device)
    with pytest.raises(KernelUnsupported, match="K <= 256"):
        tri.chunk_gated_delta_rule(q, k, v, g, beta, scale=1.0)
    q, k, v, g, beta, _ = make(3, h0=False, dtype=torch.float64, device=device)
    with pytest.raises(KernelUnsupported, match="fp32/fp16/bf16"):
        tri.recurrent_gated_delta_rule(q, k, v, g, beta, scale=1.0)


def test_ops_table_resolves():
    """Every op of the table resolves to a torch and a Triton function with the folder's name."""
    from layerzoo.plugins import resolve_object
    from layerzoo_ssm.ops import OPS, backends_of, register_all

    assert set(OPS) == {
        "gated_delta_rule_chunk", "gated_delta_rule_recurrent", "gated_delta_rule_decode",
        "mamba2_chunk_scan", "mamba2_state_update",
    }
    seen = []
    register_all(lambda op, backend, target: seen.append((op, backend, target)))
    assert len(seen) == 2 * len(OPS)
    for op in OPS:
        backends = backends_of(op)
        assert set(backends) == {"torch", "triton"}
        for target in backends.values():
            assert callable(resolve_object(target))


def test_kernel_op_falls_back_to_reference(device, assert_close):
    """Through the registry's `KernelOp` with the Triton backend forced: a key dim the kernel does
    not hold (K > 256) runs the torch reference instead, with the same result."""
    from layerzoo.kernel_registry import KernelOp
    from layerzoo_ssm.ops import backends_of

    op = KernelOp("gated_delta_rule_recurrent", backends_of("gated_delta_rule_recurrent"), env={"LAYERZOO_KERNEL_BACKEND": "triton"})
    q, k, v, g, beta, _ = make(3, K=300, V=4, h0=False, device=device)
    o, s = op(q, k, v, g, beta, scale=0.1)
    o_ref, s_ref = ref.recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.1)
    assert_close("o", o_ref, o)
    assert_close("state", s_ref, s)
    assert len(op.fallbacks) == 1


# ---- the decode op: one token per sequence, nothing read on the host ---------------------------


def test_decode_op_equals_the_recurrent_op_over_one_token_each(assert_close):
    q, k, v, g, beta, h0 = make(5, H=3, K=12, V=20, N=5, seed=3)
    o_r, s_r = ref.recurrent_gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=h0, cu_seqlens=cu([1] * 5))
    o, s = ref.gated_delta_rule_decode(q, k, v, g, beta, scale=0.3, initial_state=h0)
    assert o.shape == (5, 3, 20) and s.dtype == torch.float32
    assert_close("o", o_r, o, 1e-6)
    assert_close("state", s_r, s, 1e-6)


def test_decode_op_traces_whole():
    """Compiled as one graph (``fullgraph``): it reads nothing on the host, unlike the varlen op."""
    q, k, v, g, beta, h0 = make(3, N=3, seed=4)
    decode = torch.compile(ref.gated_delta_rule_decode, backend="eager", fullgraph=True, dynamic=False)
    o, s = decode(q, k, v, g, beta, scale=0.3, initial_state=h0)
    torch.testing.assert_close(o, ref.gated_delta_rule_decode(q, k, v, g, beta, scale=0.3, initial_state=h0)[0])
    varlen = torch.compile(ref.recurrent_gated_delta_rule, backend="eager", fullgraph=True, dynamic=False)
    with pytest.raises(Exception):
        varlen(q, k, v, g, beta, scale=0.3, initial_state=h0, cu_seqlens=cu([1] * 3))


def test_decode_op_triton_matches_reference(device, assert_close):
    q, k, v, g, beta, h0 = make(4, H=2, K=16, V=24, N=4, seed=5)
    args = [t.to(device) for t in (q, k, v, g, beta, h0)]
    o_t, s_t = tri.gated_delta_rule_decode(*args[:5], scale=0.25, initial_state=args[5])
    o, s = ref.gated_delta_rule_decode(q, k, v, g, beta, scale=0.25, initial_state=h0)
    assert_close("o", o, o_t, 1e-5)
    assert_close("state", s, s_t, 1e-5)
