"""The FP8 linear's kernels against ``reference.py``: the C++ GEMV and dequantization (CPU) and
the Triton GEMM (interpreter on CPU, compiled on a GPU), on odd shapes and every e4m3 value."""

import pytest
import torch

from layerzoo.kernels.fp8_matmul import cpu, reference

SHAPES = [(1, 7, 64, 32), (2, 33, 128, 64), (3, 5, 96, 96), (5, 17, 256, 128), (17, 9, 128, 128)]  # M, N, K, group


def every_e4m3(rows: int = 8) -> torch.Tensor:
    """All 254 finite e4m3 values (and two zeros in place of the NaNs), ``[rows, 256 / rows]``."""
    v = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return torch.nan_to_num(v, nan=0.0).to(torch.float8_e4m3fn).reshape(rows, -1)


def weights(n, k, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(n, k, generator=g) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = torch.rand(n, -(-k // group), generator=g) * 0.01
    return w, scale


def test_expand_scale_per_channel_tensor_and_block():
    s, g = reference.expand_scale(torch.tensor([2.0]), 3, 64, None)
    assert g == 64 and torch.equal(s, torch.full((3, 1), 2.0))
    s, g = reference.expand_scale(torch.tensor([[1.0], [2.0], [3.0]]), 3, 64, None)
    assert g == 64 and torch.equal(s[:, 0], torch.tensor([1.0, 2.0, 3.0]))
    block = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    s, g = reference.expand_scale(block, 5, 200, (4, 128))  # the last block of rows and columns short
    assert g == 128 and s.shape == (5, 2) and torch.equal(s[3], torch.tensor([1.0, 2.0])) and torch.equal(s[4], torch.tensor([3.0, 4.0]))


@pytest.fixture(scope="module")
def cpp():
    if not cpu.available():
        pytest.skip("C++ kernels not built")
    return cpu


def test_cpp_converts_every_e4m3_value_exactly(cpp):
    w = every_e4m3()
    assert torch.equal(cpp.dequantize(w, torch.ones(w.shape[0], 1), w.shape[1]), w.float())
    x = torch.zeros(1, w.shape[1])
    for k in (0, 5, 31):  # picks one column: the GEMV reads the same values
        x.zero_()
        x[0, k] = 1.0
        assert torch.equal(cpp.fp8_gemv(x, w, torch.ones(w.shape[0], 1), w.shape[1])[0], w.float()[:, k])


@pytest.mark.parametrize("m,n,k,group", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpp_gemv_matches_the_reference(cpp, m, n, k, group, with_bias):
    w, scale = weights(n, k, group)
    x = torch.randn(m, k)
    bias = torch.randn(n) if with_bias else None
    want = reference.matmul(x, w, scale, group, bias)
    got = cpp.fp8_gemv(x, w, scale, group, bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    assert torch.equal(torch.cat([cpp.fp8_gemv(x[i:i + 1].contiguous(), w, scale, group, bias) for i in range(m)]), got)
    assert torch.equal(cpp.dequantize(w, scale, group), reference.dequantize(w, scale, group))


@pytest.mark.parametrize("m,n,k,group", [(1, 7, 64, 32), (3, 33, 96, 64), (17, 9, 128, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_matches_the_reference(device, m, n, k, group, with_bias):
    from layerzoo.kernels.fp8_matmul import triton as fp8_triton

    w, scale = weights(n, k, group)  # (3, 33, 96, 64): a short last group
    x = torch.randn(m, k)
    bias = torch.randn(n) if with_bias else None
    want = reference.matmul(x, w, scale, group, bias)
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    got = fp8_triton.matmul(on(x), on(w), on(scale), group, on(bias)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    torch.testing.assert_close(fp8_triton.matmul(on(x[:1]), on(w), on(scale), group, on(bias)).cpu(), got[:1],
                               rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_triton_converts_every_e4m3_value_exactly(device):
    from layerzoo.kernels.fp8_matmul import triton as fp8_triton

    w = every_e4m3(4)  # [4, 64]
    eye = torch.eye(64)
    got = fp8_triton.matmul(eye.to(device), w.to(device), torch.ones(4, 1, device=device), 64).cpu()
    assert torch.equal(got.T, w.float())


@pytest.mark.parametrize("blocks", [(16, 32, 128), (128, 64, 64), (16, 16, 32)])
def test_triton_block_shapes(device, blocks):
    """The block shapes the GPU defaults pick (bf16 activations there) compute the same product."""
    from layerzoo.kernels.fp8_matmul import triton as fp8_triton

    w, scale = weights(33, 256, 128)
    x = torch.randn(5, 256)
    want = reference.matmul(x, w, scale, 128)
    got = fp8_triton.matmul(x.to(device), w.to(device), scale.to(device), 128, blocks=blocks).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
