"""The dsa_indexer_topk op: Triton (under TRITON_INTERPRET=1 on CPU) against the torch reference on
ragged shapes, and the reference's causal contract."""

import pytest
import torch

from layerzoo import testing
from layerzoo_glm53.ops.dsa_indexer_topk import reference

tri = pytest.importorskip("layerzoo_glm53.ops.dsa_indexer_topk.triton")

# (B, n, H, D, L): odd heads/dims/lengths, one-row decodes, L across a 64-key block edge
SHAPES = [(1, 1, 1, 3, 1), (3, 1, 5, 17, 70), (1, 9, 8, 16, 9), (2, 5, 3, 24, 65)]


def inputs(B, n, H, D, L, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, n, H, D, generator=g)
    w = torch.randn(B, n, H, generator=g)
    keys = torch.randn(B, L, D, generator=g)
    # each batch row a sequence of its own length; its n query rows are its last n positions
    lens = torch.randint(n, L + 1, (B,), generator=g)
    pos = lens[:, None] - n + torch.arange(n)[None, :]
    return [t.to(device) for t in (q, w, keys, pos)]


@pytest.mark.parametrize("B,n,H,D,L", SHAPES)
def test_triton_scores_and_picks_match_the_reference(B, n, H, D, L):
    device = testing.kernel_test_device()
    q, w, keys, pos = inputs(B, n, H, D, L, device)
    scale = D**-0.5
    ref = reference.dsa_indexer_scores(q, w, keys, pos, scale)
    out = tri.dsa_indexer_scores(q, w, keys, pos, scale)
    assert torch.equal(torch.isinf(ref), torch.isinf(out))  # the same keys masked
    finite = torch.isfinite(ref)
    torch.testing.assert_close(out[finite], ref[finite], atol=1e-5, rtol=1e-5)
    top = min(4, L)
    ref_picks = reference.dsa_indexer_topk(q, w, keys, pos, top, scale)
    picks = tri.dsa_indexer_topk(q, w, keys, pos, top, scale)
    # as sets, where the cut is not within rounding (ties among zeros / -inf may order freely)
    ranked = ref.sort(-1, descending=True).values
    clear = (ranked[..., top - 1] - (ranked[..., top] if top < L else -float("inf"))) > 1e-4
    same = picks.sort(-1).values == ref_picks.sort(-1).values
    assert same.all(-1)[clear].all()


def test_reference_selects_every_visible_key_when_few():
    """A row that sees fewer keys than top_k picks all of them (the rest are invisible)."""
    q, w, keys, _ = inputs(1, 3, 4, 8, 10, "cpu", seed=1)
    pos = torch.tensor([[0, 2, 9]])
    picks = reference.dsa_indexer_topk(q, w, keys, pos, 4, 8**-0.5)
    assert set(picks[0, 0].tolist()) >= {0} and set(picks[0, 1].tolist()) >= {0, 1, 2}
    assert all(p <= 9 for p in picks[0, 2].tolist())
    scores = reference.dsa_indexer_scores(q, w, keys, pos, 8**-0.5)
    assert torch.isinf(scores[0, 0, 1:]).all() and torch.isfinite(scores[0, 2]).all()


def test_the_plugin_registers_both_backends():
    from layerzoo.plugins.kernel_registry import kernels_report
    from layerzoo.plugins.manager import get_registry

    row = next(r for r in kernels_report(get_registry(), "cuda") if r["op"] == "dsa_indexer_topk")
    assert row["backends"] == {"torch": "glm53", "triton": "glm53"} and row["runs_here"] == "triton"
