"""FP8 (e4m3) KV quantisation: the reference's formula, and the Triton kernels against it.

Under the interpreter the fp32 → e4m3 cast is unreliable (a few % of values come out one binade
low, subnormals truncate) and so is fp32 → bf16 (it truncates), so on CPU the quantise kernel's
scale/clamp arithmetic is checked exactly through its fp32-output variant and its e4m3 output only
loosely; compiled on a GPU (``TRITON_INTERPRET=0 LAYERZOO_TEST_DEVICE=cuda``) everything is exact.
"""

import os

import pytest
import torch

from layerzoo.kernels.fp8_kv import reference as ref

FP8 = torch.float8_e4m3fn
INTERPRETED = os.environ.get("TRITON_INTERPRET", "1") not in ("0", "")

SHAPES = [(1, 1, 8), (37, 3, 24), (5, 2, 130), (0, 2, 8)]


@pytest.fixture
def device() -> torch.device:
    """``$LAYERZOO_TEST_DEVICE`` (e.g. ``cuda``, with ``TRITON_INTERPRET=0``), else CPU."""
    return torch.device(os.environ.get("LAYERZOO_TEST_DEVICE", "cpu"))


@pytest.fixture(scope="module")
def tri():
    pytest.importorskip("triton")
    from layerzoo.kernels.fp8_kv import triton as tri

    return tri


def values(shape, device, dtype=torch.float32, seed=0):
    """Magnitudes over six decades, so normals, subnormals and the clamp all show up."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 3, shape[-1])
    return x.to(device=device, dtype=dtype)


# -- the reference ------------------------------------------------------------------------------


def test_reference_formula_and_clamp():
    scale = torch.tensor(0.5)
    x = torch.tensor([[[0.0, 1.0, -3.0, 224.0, 1000.0, -1e9, 0.3]]])
    x8 = ref.quantize_fp8(x, scale)
    assert x8.dtype == FP8 and x8.shape == x.shape
    assert x8.float().tolist() == [[[0.0, 2.0, -6.0, 448.0, 448.0, -448.0, 0.625]]]  # 0.6 -> nearest e4m3
    assert ref.dequantize_fp8(x8, scale, torch.float16).dtype == torch.float16
    assert ref.dequantize_fp8(x8, scale).tolist() == [[[0.0, 1.0, -3.0, 224.0, 224.0, -224.0, 0.3125]]]


def test_reference_round_trip_error_is_fp8_sized():
    x = values((64, 4, 32), "cpu")
    scale = x.abs().amax() / 448
    back = ref.dequantize_fp8(ref.quantize_fp8(x, scale), scale)
    normal = (x / scale).abs() >= 2**-6
    rel = ((back - x).abs() / x.abs())[normal]
    assert rel.max() <= 2**-4 + 1e-6  # half an ulp of a 3-bit mantissa
    assert (back - x).abs()[~normal].max() <= scale * 2**-10  # subnormal spacing 2^-9, halved


# -- Triton against the reference ---------------------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_quantize_scaled_values_exact(tri, device, shape, dtype):
    """The kernel's x / scale and clamp, written as fp32 (the cast left to torch): bit-exact."""
    x = values(shape, device, dtype)
    scale = torch.tensor(0.37, device=device)
    out = tri.quantize_into(x, scale, torch.full(shape, float("nan"), device=device))
    expected = (x.float() / scale).clamp(-448, 448)
    assert torch.equal(out, expected)
    assert torch.equal(out.to(FP8).view(torch.uint8), ref.quantize_fp8(x, scale).view(torch.uint8))


@pytest.mark.parametrize("shape", SHAPES)
def test_triton_quantize_fp8_output(tri, device, shape):
    x = values(shape, device)
    scale = torch.tensor(0.37, device=device)
    out, expected = tri.quantize_fp8(x, scale), ref.quantize_fp8(x, scale)
    assert out.dtype == FP8 and out.shape == expected.shape
    if not INTERPRETED:
        assert torch.equal(out.view(torch.uint8), expected.view(torch.uint8))
        return
    # Interpreter: the cast misrounds some values toward zero, by at most half a value or one
    # subnormal step (2^-9).
    got, want = out.float(), expected.float()
    if got.numel():
        assert (got != want).float().mean() <= 0.2
    assert (got.abs() <= want.abs()).all() and (got * want >= 0).all()
    assert ((got - want).abs() <= 0.5 * want.abs() + 2**-9).all()


def test_triton_quantize_non_contiguous_input(tri, device):
    x = values((8, 6, 16), device).transpose(0, 1)  # [6, 8, 16], strided
    scale = torch.tensor(2.0, device=device)
    out = tri.quantize_into(x, scale, torch.empty(x.shape, device=device))
    assert torch.equal(out, (x / scale).clamp(-448, 448))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_dequantize(tri, device, shape, dtype):
    x8 = ref.quantize_fp8(values(shape, device), torch.tensor(0.37, device=device))
    scale = torch.tensor(0.37, device=device)
    out, expected = tri.dequantize_fp8(x8, scale, dtype), ref.dequantize_fp8(x8, scale, dtype)
    assert out.dtype == dtype and out.shape == expected.shape
    if dtype == torch.bfloat16 and INTERPRETED:  # the interpreter truncates fp32 -> bf16
        assert ((out.float() - expected.float()).abs() <= expected.float().abs() * 2**-7).all()
    else:
        assert torch.equal(out, expected)


def test_triton_reads_the_scale_tensor_each_call(tri, device):
    """The scale is read from its tensor at run time (a graph replays an in-place update)."""
    x = values((4, 2, 8), device)
    scale = torch.tensor(1.0, device=device)
    x8 = ref.quantize_fp8(x, scale)
    first = tri.dequantize_fp8(x8, scale)
    scale.mul_(3)
    assert torch.equal(tri.dequantize_fp8(x8, scale), first * 3)
    out = torch.empty(x.shape, device=device)
    assert torch.equal(tri.quantize_into(x, scale, out), (x / scale).clamp(-448, 448))


def test_ops_registered():
    from layerzoo.kernels import backends_of

    for op, fn in (("fp8_quantize", "quantize_fp8"), ("fp8_dequantize", "dequantize_fp8")):
        backends = backends_of(op)
        assert backends["torch"] == f"layerzoo.kernels.fp8_kv.reference:{fn}"
        assert backends["triton"] == f"layerzoo.kernels.fp8_kv.triton:{fn}"
