"""The MXFP4 expert matmul's kernels against ``reference.py``: the format itself (every code, every
scale byte), the C++ GEMV and dequantization (CPU) and the CPU expert split, and the Triton grouped
GEMM (interpreter on CPU, compiled on a GPU), on odd shapes with experts that get no rows."""

import math

import pytest
import torch

from layerzoo.kernels.mxfp4_matmul import cpu, reference

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

# rows, experts, N, K (K a multiple of 32); the row -> expert draws leave some experts without rows
SHAPES = [(1, 3, 7, 32), (5, 4, 33, 64), (9, 6, 17, 96), (17, 2, 5, 128), (3, 8, 40, 224)]


def weights(e, n, k, seed=0):
    """Random codes and scales near 2^0 (s in 120..134, as real experts' are)."""
    g = torch.Generator().manual_seed(seed)
    packed = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(120, 135, (e, n, k // 32), generator=g, dtype=torch.uint8)
    return packed, scale


def routed(rows, e, seed=1):
    """``experts [rows]`` drawn from the odd-numbered experts only (the even ones get no rows) when there are 3+."""
    g = torch.Generator().manual_seed(seed)
    pool = torch.arange(1, e, 2) if e >= 3 else torch.arange(e)
    return pool[torch.randint(0, len(pool), (rows,), generator=g)]


def test_dequantize_is_the_format():
    """Every code at several scale bytes (subnormal 2^-127 included) against the definition, written out."""
    codes = torch.arange(16, dtype=torch.uint8)
    packed = (codes[0::2] | (codes[1::2] << 4)).repeat(2).reshape(1, 16)  # 32 columns: codes 0..15 twice
    for s in (0, 1, 100, 127, 130, 254):
        w = reference.dequantize(packed, torch.tensor([[s]], dtype=torch.uint8))
        want = [(-1) ** (c >> 3) * math.ldexp(E2M1[c & 7], s - 127) for c in list(range(16)) * 2]
        assert torch.equal(w, torch.tensor([want], dtype=torch.float32)), s  # fp32: 6 * 2^127 overflows to inf


def test_layout_mistakes_are_named():
    packed, scale = weights(1, 4, 64)
    with pytest.raises(ValueError, match="uint8"):
        reference.dequantize(packed.float(), scale)
    with pytest.raises(ValueError, match=r"K/32"):
        reference.dequantize(packed, scale[..., :1])


@pytest.fixture(scope="module")
def cpp():
    if not cpu.available():
        pytest.skip("C++ kernels not built")
    return cpu


def close(got, want):
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("rows,e,n,k", SHAPES)
def test_cpp_gemv_matches_the_reference(cpp, rows, e, n, k):
    packed, scale = weights(e, n, k)
    x, experts = torch.randn(rows, k), routed(rows, e)
    want = reference.expert_matmul(x, experts, packed, scale)
    got = cpp.gemv(x, packed, scale, experts)
    close(got, want)
    # each row alone gives bitwise the same result as in its batch (tiles of 1-4 rows of one expert)
    alone = torch.cat([cpp.gemv(x[i:i + 1].contiguous(), packed, scale, experts[i:i + 1].contiguous()) for i in range(rows)])
    assert torch.equal(alone, got)


def test_cpp_gemv_of_one_weight(cpp):
    packed, scale = weights(1, 33, 96)
    x = torch.randn(3, 96)
    close(cpp.gemv(x, packed[0], scale[0]), reference.matmul(x, packed[0], scale[0]))


def test_cpp_gemv_refuses_a_row_without_expert(cpp):
    packed, scale = weights(2, 4, 32)
    with pytest.raises(RuntimeError, match=r"expert 2 of row 0 is not in \[0, 2\)"):
        cpp.gemv(torch.randn(1, 32), packed, scale, torch.tensor([2]))


def test_cpp_dequantize_is_bitwise_the_reference(cpp):
    """Every code byte with every finite scale byte (0..254), and a stacked [E, N, K/2] weight."""
    packed = torch.arange(256, dtype=torch.uint8).repeat(255, 1)  # [255, 256]: K = 512
    scale = torch.arange(255, dtype=torch.uint8)[:, None].repeat(1, 16)
    assert torch.equal(cpp.dequantize(packed, scale), reference.dequantize(packed, scale))
    packed, scale = weights(3, 7, 96)
    out = torch.full((3 * 7 * 96 + 5,), float("nan"))
    assert torch.equal(cpp.dequantize(packed, scale, out[: 3 * 7 * 96]), reference.dequantize(packed, scale))


@pytest.mark.parametrize("gemv_rows", [0, 4])
def test_cpp_expert_matmul_splits_few_and_many_rows(cpp, monkeypatch, gemv_rows):
    """Experts with many rows dequantize + GEMM, the others run the GEMV, in one call; an expert
    without rows and rows in any order."""
    monkeypatch.setattr(cpu, "GEMV_ROWS", gemv_rows)
    packed, scale = weights(5, 17, 64)
    experts = torch.tensor([3] * 9 + [1, 4, 1, 0] + [3] * 2)[torch.randperm(15, generator=torch.Generator().manual_seed(2))]
    x = torch.randn(15, 64)
    close(cpu.expert_matmul(x, experts, packed, scale), reference.expert_matmul(x, experts, packed, scale))
    assert cpu.expert_matmul(x[:0], experts[:0], packed, scale).shape == (0, 17)


@pytest.mark.parametrize("rows,e,n,k", SHAPES[:4])
def test_triton_matches_the_reference(device, rows, e, n, k):
    from layerzoo.kernels.mxfp4_matmul import triton as mxfp4_triton

    packed, scale = weights(e, n, k)
    x, experts = torch.randn(rows, k), routed(rows, e)
    want = reference.expert_matmul(x, experts, packed, scale)
    got = mxfp4_triton.expert_matmul(x.to(device), experts.to(device), packed.to(device), scale.to(device)).cpu()
    close(got, want)


@pytest.mark.parametrize("blocks", [(16, 16, 64), (32, 64, 32)])
def test_triton_block_shapes_and_bf16(device, blocks):
    """Other block shapes (a K slice over two groups, a short last K slice) and bf16 activations
    (the weights exact in bf16, products summed in fp32)."""
    from layerzoo.kernels.mxfp4_matmul import triton as mxfp4_triton

    packed, scale = weights(4, 19, 96)
    x, experts = torch.randn(7, 96).bfloat16(), routed(7, 4)
    want = reference.expert_matmul(x, experts, packed, scale)
    on = lambda t: t.to(device)  # noqa: E731
    got = mxfp4_triton.expert_matmul(on(x), on(experts), on(packed), on(scale), blocks=blocks).cpu()
    close(got, want)
    assert mxfp4_triton.expert_matmul(on(x[:0]), on(experts[:0]), on(packed), on(scale)).shape == (0, 19)


SCALAR_CHECK = """
import hashlib, sys
from pathlib import Path
import torch
from torch.utils import cpp_extension
source = Path(sys.argv[1])
name = "layerzoo_mxfp4_scalar_" + hashlib.sha256(source.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
cpp_extension.load(name=name, sources=[str(source)], extra_cflags=["-O2", "-mno-avx", "-mno-avx2", "-mno-fma", "-fopenmp"],
                   extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
from layerzoo.kernels.mxfp4_matmul import reference
g = torch.Generator().manual_seed(0)
for rows, e, n, k in [(1, 3, 7, 32), (9, 6, 17, 96), (5, 2, 33, 224)]:
    packed = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(120, 135, (e, n, k // 32), generator=g, dtype=torch.uint8)
    x, experts = torch.randn(rows, k, generator=g), torch.randint(0, e, (rows,), generator=g)
    want = reference.expert_matmul(x, experts, packed, scale)
    got = torch.ops.layerzoo_cpu.mxfp4_gemv(x, packed, scale, experts)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    out = torch.empty(e * n * k)
    torch.ops.layerzoo_cpu.mxfp4_dequantize(packed, scale, out)
    assert torch.equal(out.view(e, n, k), reference.dequantize(packed, scale))
print("scalar ok")
"""


def test_scalar_build_matches_the_reference(cpp, tmp_path):
    """The kernel file built without AVX2 (its scalar fallback, in a process of its own: the ops'
    names are the main library's) against the reference."""
    import subprocess
    import sys
    from pathlib import Path

    source = Path(cpu.__file__).with_name("mxfp4_cpu.cpp")
    run = subprocess.run([sys.executable, "-c", SCALAR_CHECK, str(source)], capture_output=True, text=True, timeout=900)
    assert run.returncode == 0 and "scalar ok" in run.stdout, run.stderr[-3000:]
