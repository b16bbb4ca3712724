"""Causal conv1d: the reference against torch's conv1d and transformers' Mamba2 helpers, prefill ==
prefill + update, varlen == separate calls, and the Triton kernels == the reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels.causal_conv1d import reference as ref

tri = pytest.importorskip("layerzoo.kernels.causal_conv1d.triton")

RATIO = {torch.float32: 1e-5, torch.bfloat16: 1e-2}


def make(T, D=24, W=4, N=1, *, seed=0, dtype=torch.float32, device="cpu", state=True, bias=True):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=gen).to(dtype).to(device)
    w = torch.randn(D, W, generator=gen).to(dtype).to(device)
    b = torch.randn(D, generator=gen).to(dtype).to(device) if bias else None
    s = torch.randn(N, D, W - 1, generator=gen).to(dtype).to(device) if state else None
    return x, w, b, s


def cu(lens, device="cpu"):
    return torch.tensor([0, *lens], device=device).cumsum(0)


@pytest.mark.parametrize("activation", ["silu", None])
@pytest.mark.parametrize("T", [1, 2, 3, 17])
def test_reference_matches_torch_conv1d(T, activation, assert_close):
    """No state: zero left padding, as ``F.conv1d(padding=W-1)``; the state is the last W-1 inputs."""
    x, w, b, _ = make(T, state=False)
    y, s = ref.causal_conv1d(x, w, b, activation=activation)
    y_t = F.conv1d(x.T[None], w[:, None, :], b, padding=3, groups=24)[0, :, :T].T
    assert_close("y", F.silu(y_t) if activation else y_t, y)
    padded = torch.cat([torch.zeros(3, 24), x])
    assert torch.equal(s[0], padded[-3:].T)


def test_reference_matches_transformers(assert_close):
    """transformers' Mamba2 torch fallbacks: ``causal_conv1d_fn`` (prefill, no state) and
    ``causal_conv1d_update`` (in place on a ``[B, D, W-1]`` state)."""
    mm = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    hf_fn = getattr(mm.causal_conv1d_fn, "__wrapped__", mm.causal_conv1d_fn)
    hf_update = getattr(mm.causal_conv1d_update, "__wrapped__", mm.causal_conv1d_update)
    x, w, b, s = make(9, N=3, seed=1)
    y, _ = ref.causal_conv1d(x, w, b)
    assert_close("prefill", hf_fn(x.T[None], w, b, activation="silu")[0].T, y)
    state = s.clone()
    y_hf = hf_update(x[:3, :, None], state, w, b, activation="silu")[..., 0]
    y, new_state = ref.causal_conv1d_update(x[:3], s, w, b)
    assert_close("update", y_hf, y)
    assert torch.equal(new_state, state)


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("W", [2, 4])
def test_prefill_equals_prefill_then_update(impl, W, device, assert_close):
    """prefill(T) == prefill(T-1) then update(1), for a few sequences (one shorter than W-1)."""
    op = ref if impl == "reference" else tri
    lens = [1, 2, 6]
    x, w, b, s = make(sum(lens), W=W, N=3, seed=2, device=device)
    y, s_full = op.causal_conv1d(x, w, b, conv_state=s, cu_seqlens=cu(lens, device))
    starts = cu(lens).tolist()
    for n, (a, e) in enumerate(zip(starts[:-1], starts[1:])):
        y1, s1 = op.causal_conv1d(x[a : e - 1], w, b, conv_state=s[n : n + 1])
        y2, s2 = op.causal_conv1d_update(x[e - 1 : e], s1, w, b)
        assert_close(f"y[{n}]", y[a:e], torch.cat([y1, y2]))
        assert torch.equal(s2[0], s_full[n])


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_split_prefill_and_varlen_equal_one_call(impl, device, assert_close):
    op = ref if impl == "reference" else tri
    lens = [5, 0, 1, 13]
    x, w, b, s = make(sum(lens), N=len(lens), seed=3, device=device)
    y, s_out = op.causal_conv1d(x, w, b, conv_state=s, cu_seqlens=cu(lens, device))
    starts = cu(lens).tolist()
    for n, (a, e) in enumerate(zip(starts[:-1], starts[1:])):
        m = (a + e) // 2  # two prefill chunks, the state carried between them
        y1, s1 = op.causal_conv1d(x[a:m], w, b, conv_state=s[n : n + 1])
        y2, s2 = op.causal_conv1d(x[m:e], w, b, conv_state=s1)
        if e > a:
            assert_close(f"y[{n}]", y[a:e], torch.cat([y1, y2]))
        assert torch.equal(s2[0], s_out[n])
    assert torch.equal(s_out[1], s[1])  # the empty sequence keeps its state


def test_update_is_functional(device):
    x, w, b, s = make(2, N=2, seed=4, device=device)
    before = s.clone()
    for op in (ref, tri):
        op.causal_conv1d_update(x, s, w, b)
        assert torch.equal(s, before)


TRITON_CASES = [  # (lens or None, D, W, dtype, state, bias, activation)
    ([1, 2, 37], 24, 4, torch.float32, True, True, "silu"),
    (None, 70, 3, torch.float32, False, False, None),  # two channel blocks under a GPU's BD = 64
    ([4, 0, 9], 16, 2, torch.bfloat16, True, True, "silu"),
]


def _id(case):
    lens, D, W, dtype, st, bias, act = case
    return f"{'x'.join(map(str, lens)) if lens else 'single'}-D{D}-W{W}-{str(dtype)[6:]}-s{int(st)}-b{int(bias)}-{act}"


@pytest.mark.parametrize("case", TRITON_CASES, ids=_id)
def test_triton_matches_reference(case, device, nan_empty, assert_close):
    lens, D, W, dtype, st, bias, act = case
    T = sum(lens) if lens else 45
    x, w, b, s = make(T, D, W, len(lens) if lens else 1, seed=5, dtype=dtype, device=device, state=st, bias=bias)
    kw = dict(conv_state=s, cu_seqlens=cu(lens, device) if lens else None, activation=act)
    y, s_out = tri.causal_conv1d(x, w, b, **kw)
    y_ref, s_ref = ref.causal_conv1d(x, w, b, **kw)
    assert y.dtype == dtype and s_out.dtype == dtype
    assert_close("y", y_ref, y, RATIO[dtype])
    assert torch.equal(s_out, s_ref)


def test_triton_update_matches_reference_strided(device, nan_empty, assert_close):
    """x a column slice of a wider projection; an fp32 state next to bf16 inputs."""
    gen = torch.Generator().manual_seed(6)
    wide = torch.randn(5, 40, generator=gen).to(device)
    x = wide[:, 3:27]
    _, w, b, s = make(1, N=5, seed=7, device=device)
    y, s_new = tri.causal_conv1d_update(x, s, w, b)
    y_ref, s_ref = ref.causal_conv1d_update(x, s, w, b)
    assert_close("y", y_ref, y)
    assert torch.equal(s_new, s_ref)
    xb, sb = x.to(torch.bfloat16), s.float()
    y, s_new = tri.causal_conv1d_update(xb, sb, w.to(torch.bfloat16), None)
    y_ref, s_ref = ref.causal_conv1d_update(xb, sb, w.to(torch.bfloat16), None)
    assert y.dtype == torch.bfloat16 and s_new.dtype == torch.float32
    assert_close("y bf16", y_ref, y, 1e-2)
    assert torch.equal(s_new, s_ref)


def test_triton_unsupported_inputs_fall_back(device):
    x, w, b, _ = make(3, W=1, state=False, device=device)
    with pytest.raises(KernelUnsupported, match="width"):
        tri.causal_conv1d(x, w, b)
    x, w, b, _ = make(3, state=False, dtype=torch.float64, device=device)
    with pytest.raises(KernelUnsupported, match="fp32/fp16/bf16"):
        tri.causal_conv1d(x, w, b)
