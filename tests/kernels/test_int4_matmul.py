"""The 4-bit linear's kernels against ``reference.py``: the C++ GEMV and dequantization (CPU) and
the Triton GEMM (interpreter on CPU, compiled on a GPU), on odd shapes."""

import pytest
import torch

from layerzoo.kernels.int4_matmul import cpu, reference

SHAPES = [(1, 7, 64, 32), (2, 33, 128, 64), (3, 5, 96, 32), (5, 17, 256, 128), (17, 9, 128, 128)]  # M, N, K, group


def weights(n, k, group, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = reference.pack(torch.randint(0, 16, (n, k), generator=g))
    scale = (torch.rand(n, k // group, generator=g) * 0.1).half().float()
    zs = torch.randint(0, 16, (n, k // group), generator=g).float() * scale
    return q, scale, zs


def test_pack_is_the_layout():
    values = torch.arange(64).remainder(16).reshape(1, 64)
    q = reference.pack(values)
    assert q[0, 0] == values[0, 0] | (values[0, 16] << 4) and q[0, 16] == values[0, 32] | (values[0, 48] << 4)
    assert torch.equal(reference.unpack(q), values.to(torch.uint8))


@pytest.fixture(scope="module")
def cpp():
    if not cpu.available():
        pytest.skip("C++ kernels not built")
    return cpu


@pytest.mark.parametrize("m,n,k,group", SHAPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_cpp_gemv_matches_the_reference(cpp, m, n, k, group, with_bias):
    q, scale, zs = weights(n, k, group)
    x = torch.randn(m, k)
    bias = torch.randn(n) if with_bias else None
    want = reference.matmul(x, q, scale, zs, group, bias)
    got = cpp.int4_gemv(x, q, scale, zs, group, bias)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # each row alone gives bitwise the same result as in its batch
    assert torch.equal(torch.cat([cpp.int4_gemv(x[i:i + 1].contiguous(), q, scale, zs, group, bias) for i in range(m)]), got)


@pytest.mark.parametrize("m,n,k,group", SHAPES)
def test_cpp_dequantize_is_bitwise_the_reference(cpp, m, n, k, group):
    q, scale, zs = weights(n, k, group)
    assert torch.equal(cpp.dequantize(q, scale, zs, group), reference.dequantize(q, scale, zs, group))
    out = torch.full((n * k + 5,), float("nan"))
    assert torch.equal(cpp.dequantize(q, scale, zs, group, out[: n * k]), reference.dequantize(q, scale, zs, group))


@pytest.mark.parametrize("m,n,k,group", [(1, 7, 64, 32), (3, 33, 128, 64), (17, 9, 128, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_triton_matches_the_reference(device, m, n, k, group, with_bias):
    from layerzoo.kernels.int4_matmul import triton as int4_triton

    q, scale, zs = weights(n, k, group)
    x = torch.randn(m, k)
    bias = torch.randn(n) if with_bias else None
    want = reference.matmul(x, q, scale, zs, group, bias)
    on = lambda t: None if t is None else t.to(device)  # noqa: E731
    got = int4_triton.matmul(on(x), on(q), on(scale), on(zs), group, on(bias)).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    # rows do not depend on their batch
    torch.testing.assert_close(int4_triton.matmul(on(x[:1]), on(q), on(scale), on(zs), group, on(bias)).cpu(), got[:1],
                               rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("blocks", [(16, 64, 128), (128, 64, 64), (16, 16, 32)])
def test_triton_block_shapes(device, blocks):
    """The block shapes the GPU defaults pick (bf16 activations there) compute the same product."""
    from layerzoo.kernels.int4_matmul import triton as int4_triton

    q, scale, zs = weights(33, 256, 128)
    x = torch.randn(5, 256)
    want = reference.matmul(x, q, scale, zs, 128)
    got = int4_triton.matmul(x.to(device), q.to(device), scale.to(device), zs.to(device), 128, blocks=blocks).cpu()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
