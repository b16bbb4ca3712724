"""``argmax_finite``: the C++ kernel against torch.argmax and the finiteness screen, on odd
vocabulary sizes (partial chunks and vector tails), ties, and rows with NaN or infinities."""

from __future__ import annotations

import shutil

import pytest
import torch

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels import cpp_build
from layerzoo.kernels.argmax import cpp, reference

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler: the kernel cannot be built here", allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def _library_loaded():
    assert cpp_build.available(), cpp_build.why_unavailable()


@pytest.mark.parametrize("B,V", [(1, 1), (1, 7), (3, 16), (2, 255), (2, 256), (4, 257), (5, 1000), (2, 151936)])
def test_matches_torch_argmax(B, V):
    g = torch.Generator().manual_seed(B * 7919 + V)
    logits = torch.randn(B, V, generator=g) * 10
    assert torch.equal(cpp.argmax_finite(logits), logits.argmax(dim=-1))
    assert torch.equal(reference.argmax_finite(logits), logits.argmax(dim=-1))


@pytest.mark.parametrize("V", [5, 300, 4099])
def test_ties_take_the_first_index(V):
    logits = torch.zeros(3, V)
    for row, spots in enumerate([(V - 1, 0), (V // 2, V - 1), (1, 2)]):
        logits[row, list(spots)] = 4.0
    expected = torch.tensor([0, V // 2, 1])
    assert torch.equal(cpp.argmax_finite(logits), expected)
    assert torch.equal(logits.argmax(dim=-1), expected)
    negative = torch.full((1, V), -3.0)  # maxima below zero, -0.0 against 0.0
    negative[0, V - 1] = -1.0
    assert cpp.argmax_finite(negative).item() == V - 1
    signed_zeros = torch.full((1, V), -1.0)
    signed_zeros[0, 1], signed_zeros[0, V - 1] = -0.0, 0.0
    assert cpp.argmax_finite(signed_zeros).item() == signed_zeros.argmax().item() == 1


@pytest.mark.parametrize("V", [9, 256, 1031])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_rows_with_nan_or_inf_are_minus_one(V, bad):
    logits = torch.randn(4, V, generator=torch.Generator().manual_seed(V))
    for row, col in ((1, 0), (3, V - 1)):  # first value, and the vector tail or a full chunk's last
        logits[row, col] = bad
    expected = torch.tensor([logits[0].argmax().item(), -1, logits[2].argmax().item(), -1])
    assert torch.equal(cpp.argmax_finite(logits), expected)
    assert torch.equal(reference.argmax_finite(logits), expected)


def test_other_dtypes_go_to_the_reference():
    with pytest.raises(KernelUnsupported):
        cpp.argmax_finite(torch.randn(2, 9).bfloat16())
    with pytest.raises(RuntimeError, match="argmax_finite: contiguous fp32"):
        torch.ops.layerzoo_cpu.argmax_finite(torch.randn(2, 3, 4))
