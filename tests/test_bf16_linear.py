"""bf16 linears on CPU: oneDNN-packed where the CPU has native bf16, plain F.linear elsewhere;
either way the same products as a bf16 ``nn.Linear``."""

import pytest
import torch
from torch import nn

from layerzoo.layers.linear import pack_linears, packable_dtypes, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")


def model_and_input():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(48, 80), nn.Linear(80, 24, bias=False)).to(torch.bfloat16).requires_grad_(False)
    return m, torch.randn(7, 48).to(torch.bfloat16)


def test_packable_dtypes_follow_the_cpu():
    assert torch.float32 in packable_dtypes()
    assert (torch.bfloat16 in packable_dtypes()) == torch.ops.mkldnn._is_mkldnn_bf16_supported()


def test_bf16_linears_compute_the_same_products():
    m, x = model_and_input()
    with torch.no_grad():
        ref = m(x)
        packed = pack_linears(m)
        out = m(x)
    assert packed == (2 if torch.bfloat16 in packable_dtypes() else 0)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(torch.bfloat16 not in packable_dtypes(), reason="this CPU has no native bf16 (oneDNN will not pack it)")
def test_native_bf16_cpu_packs_bf16_weights():
    m, x = model_and_input()
    pack_linears(m)
    assert all(hasattr(layer, "packed_weight") for layer in m)
