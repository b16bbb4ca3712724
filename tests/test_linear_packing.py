"""oneDNN weight packing of CPU fp32 linears: same results, tied weights kept, switchable."""

import pytest
import torch
from torch import nn

from layerzoo.layers.linear import pack_linears, packable_dtypes, packing_available

pytestmark = pytest.mark.skipif(not packing_available(), reason="torch built without oneDNN")


def model():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 24, bias=False))
    m.tied = nn.Linear(24, 40, bias=False)
    m.tied.weight = m[0].weight
    return m.eval()


@pytest.mark.parametrize("rows", [1, 3, 8, 257])
def test_packed_linears_match_plain_ones(rows):
    plain, packed = model(), model()
    assert pack_linears(packed, shared={id(packed[0].weight)}) == 3
    x = torch.randn(rows, 24)
    with torch.no_grad():
        torch.testing.assert_close(packed[1](packed[0](x)), plain[1](plain[0](x)), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(packed[0](x[None]), plain[0](x[None]), atol=1e-5, rtol=1e-5)  # leading dims


def test_packed_linears_are_a_linear_method_that_answers_for_itself():
    """Packing replaces each linear by a PackedLinear (nothing is bolted onto nn.Linear): its
    dequantized weight is the plain one, and the fused decode layer asks it, not its tensors."""
    from layerzoo.layers.linear import PackedLinear
    from layerzoo.layers.linear_method import LinearMethod

    plain, packed = model(), model()
    pack_linears(packed, shared={id(packed[0].weight)})
    assert all(type(layer) is PackedLinear and isinstance(layer, LinearMethod) for layer in (packed[0], packed[1], packed.tied))
    for p, q in ((plain[0], packed[0]), (plain[1], packed[1]), (plain.tied, packed.tied)):
        torch.testing.assert_close(q.dequantized_weight(), p.weight.detach(), atol=0, rtol=0)
        assert (q.fused_part() is not None) is q.packed_gemv  # by address only where the kernel reads it
    assert type(plain[0]) is nn.Linear and not hasattr(plain[0], "packed_weight")


def test_a_shared_weight_keeps_its_plain_copy():
    m = model()
    shared = m[0].weight
    pack_linears(m, shared={id(shared)})
    assert m[0].weight is shared and m.tied.weight is shared and not shared.is_mkldnn
    assert m[1].weight.is_mkldnn  # unshared: replaced by the packed tensor, no second copy


def test_switched_off_by_env_and_skips_other_dtypes(monkeypatch):
    monkeypatch.setenv("LAYERZOO_CPU_PACKED_LINEAR", "0")
    assert pack_linears(model()) == 0
    monkeypatch.delenv("LAYERZOO_CPU_PACKED_LINEAR")
    assert pack_linears(model().to(torch.float16)) == 0  # never packed
    # bf16 is packed only where oneDNN takes it (native bf16, or AVX-512 where it emulates it)
    expected = 3 if torch.bfloat16 in packable_dtypes() else 0
    assert pack_linears(model().to(torch.bfloat16)) == expected


def test_fused_projections_match_the_separate_ones():
    from layerzoo.layers.mlp import GatedMLP

    torch.manual_seed(1)
    plain = GatedMLP(24, 40).eval()
    fused = GatedMLP(24, 40).eval()
    fused.load_state_dict(plain.state_dict())
    assert pack_linears(fused) == 2  # gate_up (fused) and down_proj
    assert not hasattr(fused, "gate_proj") and fused.gate_up.out_features == 80
    x = torch.randn(5, 24)
    with torch.no_grad():
        torch.testing.assert_close(fused(x), plain(x), atol=1e-5, rtol=1e-5)


AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")


@pytest.mark.skipif(not AVX512, reason="the few-row kernel reads oneDNN's AVX-512 layout")
def test_few_rows_run_the_kernel_that_reads_the_packed_weight(monkeypatch):
    """Up to FP32_GEMV_ROWS rows go to the C++ kernel over oneDNN's packed buffer (checked at load);
    more rows stay with oneDNN; both equal the plain linear."""
    import layerzoo.layers.linear as linear

    plain, packed = model(), model()
    pack_linears(packed, shared={id(packed[0].weight)})
    assert all(layer.packed_gemv for layer in (packed[0], packed[1], packed.tied))
    calls = []
    real = linear.packed_gemv
    monkeypatch.setattr(linear, "packed_gemv", lambda layer, flat: calls.append(flat.shape[0]) or real(layer, flat))
    with torch.no_grad():
        for rows in (1, linear.FP32_GEMV_ROWS, linear.FP32_GEMV_ROWS + 1):
            x = torch.randn(rows, 24)
            torch.testing.assert_close(packed[0](x), plain[0](x), atol=1e-5, rtol=1e-5)
    assert calls == [1, linear.FP32_GEMV_ROWS]


@pytest.mark.skipif(not AVX512, reason="the few-row kernel reads oneDNN's AVX-512 layout")
def test_a_layout_the_kernel_misreads_keeps_onednn(monkeypatch, caplog):
    """The load-time check multiplies one row both ways: a kernel reading the buffer wrong (here:
    the right products with the outputs in the wrong order) is not used for that layer."""
    import layerzoo.layers.linear as linear

    real = linear.packed_gemv
    monkeypatch.setattr(linear, "packed_gemv", lambda layer, flat: torch.flip(real(layer, flat), dims=[1]))
    m = model()
    with caplog.at_level("INFO", logger="layerzoo.layers.linear"):
        pack_linears(m, shared={id(m[0].weight)})
    assert not any(layer.packed_gemv for layer in (m[0], m[1], m.tied))
    assert "3 layer(s) keep oneDNN" in caplog.text and "tied" in caplog.text  # named, with the reason


@pytest.mark.skipif(not AVX512, reason="the few-row kernel reads oneDNN's AVX-512 layout")
def test_a_shape_onednn_keeps_in_another_layout_keeps_onednn(caplog):
    """oneDNN leaves a [1, 1] weight unblocked (4 bytes): its size is not the tiled layout's, so the
    layer is refused before the load-time row is multiplied (which would read past the buffer)."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(1, 1, bias=False), nn.Linear(1, 24)).eval()
    x = torch.randn(3, 1)
    want = m(x)
    with caplog.at_level("INFO", logger="layerzoo.layers.linear"):
        pack_linears(m)
    assert not m[0].packed_gemv and m[1].packed_gemv
    assert "1 layer(s) keep oneDNN" in caplog.text and ": 0" in caplog.text
    torch.testing.assert_close(m(x), want, atol=1e-6, rtol=1e-6)


def test_a_row_limit_above_the_kernels_is_clamped():
    import subprocess
    import sys

    code = "import layerzoo.layers.linear as l; print(l.FP32_GEMV_ROWS, l.FP32_GEMV_MAX_ROWS)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "LAYERZOO_FP32_GEMV_ROWS": "64"}).stdout.split()
    assert out == ["32", "32"]  # more rows would make the kernel refuse every call


NATIVE_BF16 = AVX512 and torch.bfloat16 in packable_dtypes() and "avx512_bf16" in open("/proc/cpuinfo").read()


@pytest.mark.skipif(not NATIVE_BF16, reason="the bf16 few-row kernel needs AVX-512 BF16 and oneDNN's bf16 packing")
def test_bf16_few_rows_follow_the_cpus_layout(monkeypatch):
    """A bf16 layer reads the layout this CPU packs; where that is AMX's (blocks of 32 outputs),
    oneDNN's AMX GEMM takes over from AMX_BF16_GEMV_ROWS + 1 rows, elsewhere from FP32_GEMV_ROWS + 1."""
    import layerzoo.layers.linear as linear
    from layerzoo.kernels.cpu_gemv import cpu

    torch.manual_seed(2)
    holder = nn.Sequential(nn.Linear(64, 96)).to(torch.bfloat16).eval()
    plain = nn.Linear(64, 96).to(torch.bfloat16).eval()
    plain.load_state_dict(holder[0].state_dict())
    assert pack_linears(holder) == 1
    layer = holder[0]
    assert layer.packed_gemv
    block = cpu.bf16_packed_block()
    limit = linear.AMX_BF16_GEMV_ROWS if block == 32 else linear.FP32_GEMV_ROWS
    assert layer.gemv_layout[1] == block and layer.gemv_rows == limit
    calls = []
    real = linear.packed_gemv
    monkeypatch.setattr(linear, "packed_gemv", lambda lay, flat: calls.append(flat.shape[0]) or real(lay, flat))
    with torch.no_grad():
        for rows in (1, limit, limit + 1):
            x = torch.randn(rows, 64).bfloat16()
            torch.testing.assert_close(layer(x).float(), plain(x).float(), atol=2e-2, rtol=2e-2)
    assert calls == [1, limit]
