"""The shape-static paged decode (`paged_decode_attention_static`), the op a captured decode step
uses: it gathers the whole table width and masks by context length, so its shapes never depend
on the lengths' values. Checked against `paged_decode_attention` on ragged batches whose tables
are wider than any row needs and point, past each row's length, at garbage blocks full of NaN."""

from __future__ import annotations

import pytest
import torch

from layerzoo.kernels import backends_of
from layerzoo.kernels.paged_attention import reference
from layerzoo.testing import assert_close

HKV = 2


def make_cache(lens, block_size, D, width, seed=0):
    """``(k, v, k_ref, v_ref, tables)``: sequences of ``lens`` tokens in shuffled blocks; tables are
    ``width`` blocks wide, their unused entries point at NaN blocks, last blocks have NaN tails;
    ``k_ref, v_ref`` hold zeros there (for the value-sized reference, which never reads them)."""
    gen = torch.Generator().manual_seed(seed)
    used = [-(-n // block_size) for n in lens]
    total, spare = sum(used), 3
    k = torch.randn(total + spare, block_size, HKV, D, generator=gen)
    v = torch.randn(total + spare, block_size, HKV, D, generator=gen)
    k[total:], v[total:] = float("nan"), float("nan")
    ids = torch.randperm(total, generator=gen)
    tables = torch.randint(total, total + spare, (len(lens), width), generator=gen)
    first = 0
    for b, (n, u) in enumerate(zip(lens, used)):
        tables[b, :u] = ids[first : first + u]
        first += u
        if n % block_size:
            k[tables[b, u - 1], n % block_size :] = float("nan")
            v[tables[b, u - 1], n % block_size :] = float("nan")
    return k, v, k.nan_to_num(0.0), v.nan_to_num(0.0), tables


@pytest.mark.parametrize("block_size, G, D", [(4, 1, 16), (16, 2, 40), (4, 4, 24)])
def test_static_decode_matches_the_value_sized_decode(block_size, G, D, nan_empty):
    lens = [1, 5, 16, 17, 33]
    width = -(-max(lens) // block_size) + 3  # wider than any row needs
    k, v, k_ref, v_ref, tables = make_cache(lens, block_size, D, width)
    q = torch.randn(len(lens), HKV * G, D)
    context_lens = torch.tensor(lens)
    out = reference.paged_decode_attention_static(q, k, v, tables, context_lens, D**-0.5)
    ref = reference.paged_decode_attention(q, k_ref, v_ref, tables, context_lens, D**-0.5)
    assert_close("o", ref, out)


def test_static_decode_single_row_and_empty_context(nan_empty):
    """One row is masked too (the value-sized op skips the mask for one row); an empty context
    (a padded graph row) gives zeros, not NaN."""
    k, v, k_ref, v_ref, tables = make_cache([7, 1], 4, 16, 4)
    q = torch.randn(2, HKV, 16)
    out = reference.paged_decode_attention_static(q, k, v, tables, torch.tensor([7, 0]), 0.25)
    ref = reference.paged_decode_attention(q[:1], k_ref, v_ref, tables[:1], torch.tensor([7]), 0.25)
    assert_close("o", ref, out[:1])
    assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_static_decode_shapes_do_not_depend_on_lengths():
    """Traced once as one whole graph, the op serves other lengths: nothing in it reads a length's
    value on the host (the value-sized op cannot be traced whole: it sizes its gather by one)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    k, v, _, _, tables = make_cache([9, 3], 4, 16, 4)
    k, v, q = k.nan_to_num(0.0), v.nan_to_num(0.0), torch.randn(2, HKV, 16)
    static = torch.compile(reference.paged_decode_attention_static, backend=backend, fullgraph=True, dynamic=False)
    for lens in ([9, 3], [16, 1], [2, 12]):
        context_lens = torch.tensor(lens)
        torch.testing.assert_close(
            static(q, k, v, tables, context_lens, 0.25),
            reference.paged_decode_attention(q, k, v, tables, context_lens, 0.25),
        )
    assert len(graphs) == 1
    sized = torch.compile(reference.paged_decode_attention, backend=backend, fullgraph=True, dynamic=False)
    with pytest.raises(Exception):
        sized(q, k, v, tables, torch.tensor([9, 3]), 0.25)


def test_static_decode_triton_matches_reference(device, nan_empty):
    tri = pytest.importorskip("layerzoo.kernels.paged_attention.triton")
    lens = [1, 5, 16, 17, 33]
    k, v, k_ref, v_ref, tables = make_cache(lens, 4, 40, 12)
    q = torch.randn(len(lens), HKV * 2, 40)
    context_lens = torch.tensor(lens)
    args = [t.to(device) for t in (q, k, v, tables, context_lens)]
    out = tri.paged_decode_attention_static(*args[:3], args[3], args[4], 40**-0.5)
    ref = reference.paged_decode_attention_static(q, k, v, tables, context_lens, 40**-0.5)
    assert_close("o", ref, out)


def test_static_decode_is_a_registered_op():
    assert backends_of("paged_decode_attention_static")["torch"] == (
        "layerzoo.kernels.paged_attention.reference:paged_decode_attention_static"
    )
