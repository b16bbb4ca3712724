"""Mamba2 SSD: the chunked scan == a plain per-token recurrence, == transformers' Mamba2 torch
functions, varlen / split prefill, and the Triton kernels == the references."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from layerzoo.errors import KernelUnsupported
from layerzoo_ssm.ops.mamba2_ssd import reference as ref

tri = pytest.importorskip("layerzoo_ssm.ops.mamba2_ssd.triton")

RATIO = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make(T, H=4, P=8, G=2, N=16, S=1, *, seed=0, dtype=torch.float32, device="cpu", h0=True, D=True):
    """``(x, dt, A, B, C, D, initial_state)``: ``dt`` softplus'ed, ``A < 0``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, P, generator=gen)
    dt = F.softplus(torch.randn(T, H, generator=gen) - 1.0)
    A = -torch.exp(torch.randn(H, generator=gen) * 0.5)
    B, C = torch.randn(T, G, N, generator=gen), torch.randn(T, G, N, generator=gen)
    Dv = torch.randn(H, generator=gen) if D else None
    state = torch.randn(S, H, P, N, generator=gen) if h0 else None
    x, dt, B, C = (t.to(dtype).to(device) for t in (x, dt, B, C))
    A = A.to(device)
    return x, dt, A, B, C, None if Dv is None else Dv.to(device), None if state is None else state.to(device)


def cu(lens, device="cpu"):
    return torch.tensor([0, *lens], device=device).cumsum(0)


def plain_recurrence(x, dt, A, B, C, D, h0):
    """``h = exp(dt A) h + dt x ⊗ B; y = h · C + D x`` token by token (one sequence, fp32)."""
    T, H, P = x.shape
    G, N = B.shape[1:]
    h = torch.zeros(H, P, N) if h0 is None else h0[0].clone()
    Bh, Ch = B.float().repeat_interleave(H // G, 1), C.float().repeat_interleave(H // G, 1)
    ys = []
    for t in range(T):
        h = h * torch.exp(dt[t].float() * A)[:, None, None] + (dt[t].float()[:, None] * x[t].float())[..., None] * Bh[t][:, None, :]
        y = (h * Ch[t][:, None, :]).sum(-1)
        ys.append(y if D is None else y + D[:, None] * x[t].float())
    return torch.stack(ys) if ys else x.float(), h[None]


@pytest.mark.parametrize("T", [1, 7, 63, 64, 65, 130])
def test_chunk_scan_matches_recurrence(T, assert_close):
    x, dt, A, B, C, D, h0 = make(T)
    y_r, h_r = plain_recurrence(x, dt, A, B, C, D, h0)
    y, h = ref.ssd_chunk_scan(x, dt, A, B, C, D=D, initial_state=h0, chunk_size=64)
    assert y.dtype == x.dtype and h.dtype == torch.float32 and h.shape == (1, 4, 8, 16)
    assert_close("y", y_r, y)
    assert_close("state", h_r, h)


def test_state_update_steps_match_chunk_scan(assert_close):
    """Token-by-token ``selective_state_update`` over a varlen batch == one chunked call."""
    lens = [3, 1, 9]
    x, dt, A, B, C, D, h0 = make(sum(lens), S=3, G=1, seed=1)
    y, h = ref.ssd_chunk_scan(x, dt, A, B, C, D=D, initial_state=h0, cu_seqlens=cu(lens), chunk_size=4)
    starts, ys, hs = cu(lens).tolist(), [], []
    for n in range(3):
        s = h0[n : n + 1]
        for t in range(starts[n], starts[n + 1]):
            y_t, s = ref.selective_state_update(s, x[t : t + 1], dt[t : t + 1], A, B[t : t + 1], C[t : t + 1], D=D)
            ys.append(y_t)
        hs.append(s)
    assert_close("y", torch.cat(ys), y)
    assert_close("state", torch.cat(hs), h)


def test_varlen_and_split_prefill_equal_single_calls(assert_close):
    lens = [5, 0, 70]
    x, dt, A, B, C, D, h0 = make(sum(lens), S=3, seed=2)
    y, h = ref.ssd_chunk_scan(x, dt, A, B, C, D=D, initial_state=h0, cu_seqlens=cu(lens), chunk_size=16)
    starts = cu(lens).tolist()
    for n, (a, e) in enumerate(zip(starts[:-1], starts[1:])):
        m = (a + e) // 2
        y1, h1 = ref.ssd_chunk_scan(x[a:m], dt[a:m], A, B[a:m], C[a:m], D=D, initial_state=h0[n : n + 1], chunk_size=16)
        y2, h2 = ref.ssd_chunk_scan(x[m:e], dt[m:e], A, B[m:e], C[m:e], D=D, initial_state=h1, chunk_size=16)
        if e > a:
            assert_close(f"y[{n}]", y[a:e], torch.cat([y1, y2]))
        assert_close(f"state[{n}]", h[n], h2[0])
    assert torch.equal(h[1], h0[1])


def test_references_match_transformers(assert_close):
    """transformers' Mamba2 torch paths: ``mamba2_chunk_scan`` (batch of 2 = our varlen, initial
    states, D) and ``mamba2_selective_state_update`` (in place)."""
    mm = pytest.importorskip("transformers.models.mamba2.modeling_mamba2")
    hf_scan = getattr(mm.mamba2_chunk_scan, "__wrapped__", mm.mamba2_chunk_scan)
    hf_update = getattr(mm.mamba2_selective_state_update, "__wrapped__", mm.mamba2_selective_state_update)
    T = 40
    x, dt, A, B, C, D, h0 = make(2 * T, S=2, seed=3)

    def batch(t):  # [2T, ...] -> [2, T, ...]
        return t.reshape(2, T, *t.shape[1:])

    y_hf, h_hf = hf_scan(
        batch(x), batch(dt), A, batch(B), batch(C), chunk_size=16, D=D, initial_states=h0, return_final_states=True
    )
    y, h = ref.ssd_chunk_scan(x, dt, A, B, C, D=D, initial_state=h0, cu_seqlens=cu([T, T]), chunk_size=32)
    assert_close("scan y", y_hf.reshape(2 * T, 4, 8), y)
    assert_close("scan state", h_hf, h)

    state = h0.clone()
    # mamba_ssm's calling convention (as Mamba2Mixer does): dt, A and D expanded over the head dims
    H, P, N = h0.shape[1:]
    dt_e, A_e, D_e = dt[:2, :, None].expand(2, H, P), A[:, None, None].expand(H, P, N), D[:, None].expand(H, P)
    y_hf = hf_update(state, x[:2], dt_e, A_e, B[:2], C[:2], D=D_e)
    y, new_state = ref.selective_state_update(h0, x[:2], dt[:2], A, B[:2], C[:2], D=D)
    assert_close("update y", y_hf, y)
    assert_close("update state", state, new_state)
    assert not torch.equal(h0, state)  # transformers updated in place; ours left h0 alone


TRITON_CASES = [  # (lens or None, H, P, G, N, dtype, initial state, D)
    ([1, 66, 30], 4, 8, 2, 16, torch.float32, True, True),  # crosses a 64-token chunk
    (None, 2, 12, 1, 10, torch.float32, False, False),  # odd dims
    (None, 1, 40, 1, 16, torch.float32, True, True),  # two P blocks
    ([0, 20], 4, 8, 4, 16, torch.bfloat16, True, True),  # one group per head, an empty sequence
]


def _id(case):
    lens, H, P, G, N, dtype, h0, D = case
    return f"{'x'.join(map(str, lens)) if lens else 'single'}-H{H}-P{P}-G{G}-N{N}-{str(dtype)[6:]}-h0{int(h0)}-D{int(D)}"


@pytest.mark.parametrize("case", TRITON_CASES, ids=_id)
def test_triton_chunk_scan_matches_reference(case, device, nan_empty, assert_close):
    lens, H, P, G, N, dtype, has_h0, has_D = case
    T = sum(lens) if lens else 50
    S = len(lens) if lens else 1
    x, dt, A, B, C, D, h0 = make(T, H, P, G, N, S, seed=4, dtype=dtype, device=device, h0=has_h0, D=has_D)
    kw = dict(D=D, initial_state=h0, cu_seqlens=cu(lens, device) if lens else None)
    y, h = tri.ssd_chunk_scan(x, dt, A, B, C, **kw)
    y_ref, h_ref = ref.ssd_chunk_scan(x, dt, A, B, C, **kw)
    assert y.dtype == dtype and h.dtype == torch.float32
    assert_close("y", y_ref, y, RATIO[dtype])
    assert_close("state", h_ref, h, RATIO[dtype])


def test_triton_chunk_scan_strided_and_split(device, nan_empty, assert_close):
    """x, B, C as views of one conv output (Mamba2's xBC); two calls with the state carried."""
    T, H, P, G, N = 40, 2, 8, 1, 16
    gen = torch.Generator().manual_seed(5)
    xBC = torch.randn(T, H * P + 2 * G * N, generator=gen).to(device)
    x = xBC[:, : H * P].view(T, H, P)
    B = xBC[:, H * P : H * P + G * N].view(T, G, N)
    C = xBC[:, H * P + G * N :].view(T, G, N)
    dt = F.softplus(torch.randn(T, H, generator=gen)).to(device)
    A = -torch.rand(H, generator=gen).to(device) - 0.1
    y_ref, h_ref = ref.ssd_chunk_scan(x, dt, A, B, C)
    y1, h1 = tri.ssd_chunk_scan(x[:25], dt[:25], A, B[:25], C[:25])
    y2, h2 = tri.ssd_chunk_scan(x[25:], dt[25:], A, B[25:], C[25:], initial_state=h1)
    assert_close("y", y_ref, torch.cat([y1, y2]))
    assert_close("state", h_ref, h2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_state_update_matches_reference(dtype, device, nan_empty, assert_close):
    x, dt, A, B, C, D, state = make(5, H=4, P=12, G=2, N=10, S=5, seed=6, dtype=dtype, device=device)
    before = state.clone()
    y, new = tri.selective_state_update(state, x, dt, A, B, C, D=D)
    y_ref, new_ref = ref.selective_state_update(state, x, dt, A, B, C, D=D)
    assert torch.equal(state, before)
    assert y.dtype == dtype and new.dtype == torch.float32
    assert_close("y", y_ref, y, RATIO[dtype])
    assert_close("state", new_ref, new, RATIO[dtype])
    y, _ = tri.selective_state_update(state, x, dt, A, B, C)
    assert_close("y without D", ref.selective_state_update(state, x, dt, A, B, C)[0], y, RATIO[dtype])


def test_triton_unsupported_inputs_fall_back(device):
    x, dt, A, B, C, D, _ = make(3, N=300, h0=False, device=device)
    with pytest.raises(KernelUnsupported, match="N <= 256"):
        tri.ssd_chunk_scan(x, dt, A, B, C, D=D)
    x, dt, A, B, C, D, state = make(2, S=2, dtype=torch.float64, device=device)
    with pytest.raises(KernelUnsupported, match="fp32/fp16/bf16"):
        tri.selective_state_update(state, x, dt, A, B, C, D=D)


def test_ops_table_resolves():
    """Every op of the plugin's table resolves to a torch and a Triton function with the folder's
    name (the gated delta rule is the core's ``delta_rule_*`` family, not the plugin's)."""
    from layerzoo.plugins.manager import resolve_object
    from layerzoo_ssm.ops import OPS, backends_of, register_all

    assert set(OPS) == {"mamba2_chunk_scan", "mamba2_state_update"}
    seen = []
    register_all(lambda op, backend, target: seen.append((op, backend, target)))
    assert len(seen) == 2 * len(OPS)
    for op in OPS:
        backends = backends_of(op)
        assert set(backends) == {"torch", "triton"}
        for target in backends.values():
            assert callable(resolve_object(target))
