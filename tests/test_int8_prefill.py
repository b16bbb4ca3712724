"""quantization="int8" for many rows at once (prefill chunks), when LAYERZOO_INT8_DEQUANT_ROWS opts
in: the weights dequantized and an fp32 product, so each row is exact for the int8 weights and no
row's activations cost another precision. Below the threshold (and by default) fbgemm runs."""

import pytest
import torch
from torch import nn

from layerzoo.layers import linear
from layerzoo.layers.linear import int8_available, pack_linears, quantize_per_channel_int8

pytestmark = pytest.mark.skipif(not int8_available(), reason="torch built without the fbgemm quantized engine")

ROWS = 64


@pytest.fixture(autouse=True)
def dequant_from_64_rows(monkeypatch):
    monkeypatch.setattr(linear, "INT8_DEQUANT_ROWS", ROWS)


def quantized_layer(bias: bool, seed: int = 0):
    torch.manual_seed(seed)
    layer = nn.Linear(96, 40, bias=bias).requires_grad_(False)
    q, scale = quantize_per_channel_int8(layer.weight)
    dequantized = q.float() * scale[:, None]
    model = nn.Sequential(layer)
    assert pack_linears(model, set(), "int8") == 1
    return model[0], dequantized


@pytest.mark.parametrize("bias", [False, True])
def test_many_rows_multiply_the_dequantized_weights_exactly(bias):
    layer, dequantized = quantized_layer(bias)
    x = torch.randn(ROWS + 3, 96)
    x[7] *= 1000  # an outlier row: with one activation scale per call it would swamp the others
    with torch.no_grad():
        out = layer(x)
    ref = x @ dequantized.t() + (layer.bias if bias else 0)
    torch.testing.assert_close(out, ref, atol=1e-3, rtol=1e-5)
    assert layer.int8_weight.data_ptr() == layer.weight.data_ptr() and layer.weight.dtype == torch.int8  # no second copy


def test_few_rows_go_through_the_int8_gemm(monkeypatch):
    layer, dequantized = quantized_layer(False, seed=1)
    x = torch.randn(layer.int8_gemv_rows + 1, 96)  # more rows than the GEMV takes
    calls, int8_gemm = [], linear.int8_linear

    def recorded(x, packed):
        calls.append(tuple(x.shape))
        return int8_gemm(x, packed)

    monkeypatch.setattr(linear, "int8_linear", recorded)
    with torch.no_grad():
        out = layer(x)
    assert calls == [tuple(x.shape)]
    ref = x @ dequantized.t()
    assert float((out - ref).norm() / ref.norm()) < 0.03  # 7-bit activations: close, not exact


def test_bf16_activations_keep_their_dtype():
    layer, dequantized = quantized_layer(True, seed=2)
    x = torch.randn(2, ROWS, 96).to(torch.bfloat16)
    with torch.no_grad():
        out = layer(x)
    assert out.shape == (2, ROWS, 40) and out.dtype == torch.bfloat16
    ref = x.float() @ dequantized.t() + layer.bias
    torch.testing.assert_close(out.float(), ref, atol=0.1, rtol=2e-2)


def test_by_default_every_call_goes_through_fbgemm(monkeypatch):
    monkeypatch.setattr(linear, "INT8_DEQUANT_ROWS", 0)
    layer, dequantized = quantized_layer(False, seed=3)
    x = torch.randn(300, 96)
    calls, int8_gemm = [], linear.int8_linear

    def recorded(x, packed):
        calls.append(tuple(x.shape))
        return int8_gemm(x, packed)

    monkeypatch.setattr(linear, "int8_linear", recorded)
    with torch.no_grad():
        layer(x)
    assert calls == [(300, 96)]
