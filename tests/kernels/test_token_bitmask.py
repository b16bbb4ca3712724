"""Structured outputs' grammar masks (`apply_token_bitmask`): the Triton kernel against the torch
reference and against a mask built token by token, on ragged vocabularies."""

import pytest
import torch

from layerzoo.kernels.sampling import reference as sample_ref

sample_tri = pytest.importorskip("layerzoo.kernels.sampling.triton")


def random_bitmask(groups: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``bits [G, ceil(V/32)]`` int32 with random allowed sets, and the same sets as bool ``[G, V]``."""
    gen = torch.Generator().manual_seed(seed)
    allowed = torch.rand(groups, vocab, generator=gen) < 0.3
    allowed[:, 0] = True  # at least one token per row
    words = (vocab + 31) // 32
    bits = torch.zeros(groups, words, dtype=torch.int64)
    for t in range(vocab):  # token by token: the layout written out, not the kernel's arithmetic
        bits[:, t // 32] |= allowed[:, t].long() << (t % 32)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)  # bit 31 is the sign bit
    return bits, allowed


@pytest.mark.parametrize("R, V, rows", [(3, 70, [0, 2]), (4, 33, [3, 1, 0]), (2, 1000, [1])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_rows_get_the_lowest_value_and_the_others_stay(R, V, rows, dtype, device):
    logits = torch.randn(R, V, generator=torch.Generator().manual_seed(R * V)).to(dtype=dtype, device=device)
    bits, allowed = random_bitmask(len(rows), V, seed=V)
    index = torch.tensor(rows)
    expected = logits.clone()
    for g, r in enumerate(rows):
        expected[r][~allowed[g].to(device)] = torch.finfo(dtype).min
    ref, tri = logits.clone(), logits.clone()
    sample_ref.apply_token_bitmask(ref, bits.to(device), index.to(device))
    sample_tri.apply_token_bitmask(tri, bits.to(device), index.to(device))
    assert torch.equal(ref, expected)
    assert torch.equal(tri, expected)


def test_the_kernel_refuses_a_bitmask_narrower_than_the_vocabulary():
    with pytest.raises(ValueError, match="W \\* 32 >= V"):
        sample_tri.apply_token_bitmask(torch.zeros(1, 40), torch.zeros(1, 1, dtype=torch.int32), torch.tensor([0]))
