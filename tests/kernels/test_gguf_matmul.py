"""GGUF block-quantized weights (``layerzoo.kernels.gguf_matmul``): the torch reference's
dequantization against the ``gguf`` package's for every type; the C++ dequantization bitwise the
reference's (whole, and by rows as an embedding looks them up); the C++ GEMV against the
reference's math on odd shapes (row chunks of 1-4 and their tails, an odd N, one output, K of 3
blocks), its int16 activation rounding small against the exact product (also with outliers in
the blocks, where int8 would not be; for the K-quants within the bound of one scale per
256-element group), Q4_K and Q6_K's int8 rounding per superblock (llama.cpp's,
`reference.round_activations`) within its own bounds, the K-quants' int32 superblock sums exact at their extremes,
each row's output independent of its batch, the file built alone for AVX2 (and AVX-512 without
VNNI) doing the same; and the inputs the ops must refuse."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from layerzoo.kernels import cpp_build
from layerzoo.kernels.gguf_matmul import cpu, reference
from layerzoo.testing.gguf_blocks import (
    EXTREME_WEIGHT,
    FP16_FIELDS,
    K_QUANTS,
    OTHER_ISAS,
    cpu_flags,
    extreme_blocks,
    make_blocks,
    other_isa_check,
)

gguf_quants = pytest.importorskip("gguf.quants")
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType  # noqa: E402

TYPES = sorted(reference.SUPPORTED_TYPES)
INT16_TYPES = [q for q in TYPES if q not in reference.INT8_ACT_TYPES]


def _name(qtype: int) -> str:
    return reference.NAMES[qtype]


def _ks(qtype: int) -> list[int]:
    return [256, 512] if qtype in K_QUANTS else [96, 256, 512]


def test_sizes_are_ggmls():
    for qtype in TYPES:
        assert reference.SIZES[qtype] == GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        assert cpu.row_bytes(qtype, 512) == 512 // reference.SIZES[qtype][0] * reference.SIZES[qtype][1]
    assert cpu.SUPPORTED_TYPES == frozenset({2, 3, 6, 7, 8, 10, 11, 12, 13, 14})


@pytest.mark.parametrize("qtype", TYPES, ids=_name)
def test_reference_dequantize_is_the_gguf_packages(qtype):
    blocks = make_blocks(qtype, 9, 512, seed=qtype)
    expected = gguf_quants.dequantize(blocks.numpy(), GGMLQuantizationType(qtype))
    got = reference.dequantize(blocks, qtype, 512)
    assert got.dtype == torch.float32 and got.shape == (9, 512)
    assert torch.isfinite(got).all()
    np.testing.assert_array_equal(got.numpy().view(np.uint32), expected.view(np.uint32))


def test_quantize_activations():
    x = torch.randn(3, 96)
    x[1, 32:64] = 0  # an all-zero block
    x[2, 5] = 40.0
    xq, scale = reference.quantize_activations(x)
    assert xq.dtype == torch.int16 and scale.shape == (3, 3)
    assert scale[1, 1] == 0 and (xq[1, 32:64] == 0).all()
    assert xq.abs().max() <= 32767 and xq[2, 5] == 32767 and scale[2, 0] == torch.tensor(40.0) / 32767
    back = (xq.float().view(3, 3, 32) * scale.unsqueeze(-1)).view(3, 96)
    assert ((back - x).abs() <= scale.repeat_interleave(32, dim=1) / 2 + 1e-6).all()


def test_quantize_activations_per_superblock():
    """The K-quants' group: one scale per 256 elements, the 32-element formats' per 32."""
    assert [reference.act_group(q) for q in TYPES] == [32] * 5 + [256] * 5
    x = torch.randn(2, 512)
    x[0, 300] = 50.0  # in the second group of row 0
    x[1, 256:] = 0
    xq, scale = reference.quantize_activations(x, 256)
    assert scale.shape == (2, 2) and scale[0, 1] == torch.tensor(50.0) / 32767 and scale[1, 1] == 0
    assert scale[0, 0] == x[0, :256].abs().max() / 32767 and xq[0, 300] == 32767 and (xq[1, 256:] == 0).all()
    back = (xq.float().view(2, 2, 256) * scale.unsqueeze(-1)).view(2, 512)
    assert ((back - x).abs() <= scale.repeat_interleave(256, dim=1) / 2 + 1e-6).all()
    with pytest.raises(ValueError, match="K=96 must be a multiple of the activation group 256"):
        reference.quantize_activations(torch.randn(1, 96), 256)


def test_quantize_activations_int8_per_superblock():
    """Q4_K and Q6_K's rounding (the GEMV's and the GEMM's): int8, max|x| / 127 per 256 (llama.cpp's Q8_K)."""
    assert sorted(reference.INT8_ACT_TYPES) == [reference.Q4_K, reference.Q6_K]
    x = torch.randn(2, 512)
    x[0, 300] = -50.0
    x[1, 256:] = 0
    xq, scale = reference.quantize_activations_int8(x)
    assert xq.dtype == torch.int8 and scale.shape == (2, 2)
    assert scale[0, 1] == torch.tensor(50.0) / 127 and xq[0, 300] == -127 and scale[1, 1] == 0 and (xq[1, 256:] == 0).all()
    back = (xq.float().view(2, 2, 256) * scale.unsqueeze(-1)).view(2, 512)
    assert ((back - x).abs() <= scale.repeat_interleave(256, dim=1) / 2 + 1e-6).all()
    assert reference.round_activations(x, reference.Q6_K)[2] == 256
    assert reference.round_activations(x, reference.Q5_K)[0].dtype == torch.int16


# -- the C++ ops ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def built():
    if not cpp_build.available():
        pytest.skip(f"the C++ kernels are not built here: {cpp_build.why_unavailable()}")
    return True


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("qtype", TYPES, ids=_name)
def test_cpp_dequantize_is_bitwise_the_reference(built, qtype):
    for k in _ks(qtype):
        blocks = make_blocks(qtype, 13, k, seed=k + qtype)
        ref = reference.dequantize(blocks, qtype, k)
        assert torch.equal(_bits(cpu.dequantize(blocks, qtype, k)), _bits(ref))
        rows = torch.tensor([7, 0, 12, 7, 3, 3, 1])  # out of order, repeated
        assert torch.equal(_bits(cpu.dequantize(blocks, qtype, k, rows)), _bits(ref[rows]))
        assert cpu.dequantize(blocks, qtype, k, torch.zeros(0, dtype=torch.long)).shape == (0, k)


@pytest.mark.parametrize("qtype", TYPES, ids=_name)
def test_cpp_gemv_is_the_references_math(built, qtype):
    gen = torch.Generator().manual_seed(qtype)
    for k in _ks(qtype):
        for n in (67, 1):
            blocks = make_blocks(qtype, n, k, seed=n * k + qtype)
            bias = torch.randn(n, generator=gen)
            for m in (1, 2, 3, 5, 17):
                x = torch.randn(m, k, generator=gen)
                for b in (None, bias):
                    got = cpu.gguf_gemv(x, blocks, qtype, k, b)
                    want = reference.gguf_matmul(x, blocks, qtype, k, b)
                    assert got.shape == (m, n) and got.dtype == torch.float32
                    scale = want.abs().max().item()
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale,
                                               msg=lambda s: f"{_name(qtype)} m={m} n={n} k={k} bias={b is not None}: {s}")
            # the int16 activation rounding stays small against the exact product (int8's ~0.5%)
            x = torch.randn(5, k, generator=gen)
            exact = reference.gguf_matmul_exact(x, blocks, qtype, k, bias)
            err = (cpu.gguf_gemv(x, blocks, qtype, k, bias) - exact).norm() / exact.norm()
            bound = 3e-2 if qtype in reference.INT8_ACT_TYPES else 2e-4 if n > 1 else 6e-4
            assert err < bound, f"{_name(qtype)} k={k} n={n}: relative error {err:.3g}"


def _int8_matmul(x: torch.Tensor, blocks: torch.Tensor, qtype: int, k: int) -> torch.Tensor:
    """The product with the activations rounded to int8 per 32-block (max|x| / 127), as llama.cpp
    and this GEMV before int16 did."""
    xb = x.reshape(x.shape[0], -1, 32)
    scale = xb.abs().amax(dim=-1, keepdim=True) / 127.0
    xq = torch.round(xb / scale.clamp_min(1e-30)).clamp(-127, 127) * scale
    return xq.reshape(x.shape) @ reference.dequantize(blocks, qtype, k).T


@pytest.mark.parametrize("qtype", INT16_TYPES, ids=_name)
def test_cpp_gemv_keeps_small_activations_beside_outliers(built, qtype):
    """Activations with a few large outliers per block, as LLM hidden states have: int8 (max|x| / 127)
    rounds the rest coarsely (~1% relative error), int16 stays well below 1e-3. (Q4_K and Q6_K
    take llama.cpp's int8 per superblock: test_cpp_gemv_k_quants_round_each_256_group_on_its_own.)"""
    k, n = 512, 64
    blocks = make_blocks(qtype, n, k, seed=7 + qtype)
    gen = torch.Generator().manual_seed(qtype)
    x = torch.randn(4, k, generator=gen)
    for b in range(k // 32):  # two outliers per block, 20-40 times the rest's scale
        pos = torch.randperm(32, generator=gen)[:2] + 32 * b
        x[:, pos] = (torch.rand(4, 2, generator=gen) * 20 + 20) * torch.randn(4, 2, generator=gen).sign()
    exact = reference.gguf_matmul_exact(x, blocks, qtype, k)
    err = ((cpu.gguf_gemv(x, blocks, qtype, k) - exact).norm() / exact.norm()).item()
    err8 = ((_int8_matmul(x, blocks, qtype, k) - exact).norm() / exact.norm()).item()
    assert err < 1e-3, f"{_name(qtype)}: int16 relative error {err:.3g} (int8 {err8:.3g})"
    assert err8 > 5e-3, f"{_name(qtype)}: int8 relative error {err8:.3g}: the test does not discriminate"


@pytest.mark.parametrize("qtype", sorted(K_QUANTS), ids=_name)
def test_cpp_gemv_k_quants_round_each_256_group_on_its_own(built, qtype):
    """An outlier 1000x the rest in a 256-group whose weights are all 0 (superblock 0: its fp16
    scales zeroed) must not coarsen the other groups: per output, |gemv - exact| stays within
    sum over groups of scale_g / 2 * sum |w| in the group (+ fp32 summation slack), the scales
    int16's (max|x| / 32767) or, for Q4_K and Q6_K, int8's (max|x| / 127). One scale for the whole
    row (the outlier's) breaks that bound."""
    quantize = reference.quantize_activations_int8 if qtype in reference.INT8_ACT_TYPES else reference.quantize_activations
    k, n = 1024, 48
    blocks = make_blocks(qtype, n, k, seed=11 + qtype).clone()
    nbytes = reference.SIZES[qtype][1]
    for off in FP16_FIELDS[qtype]:
        blocks[:, off:off + 2] = 0  # superblock 0 of every row: d (and dmin) 0, so its weights are 0
    w = reference.dequantize(blocks, qtype, k).double()
    assert (w[:, :256] == 0).all() and (w[:, 256:] != 0).any() and blocks.shape[1] == 4 * nbytes
    gen = torch.Generator().manual_seed(qtype)
    x = torch.randn(3, k, generator=gen)
    x[0, 100] = 3000.0  # row 0: in the zero-weight group 0
    x[1, 700] = -3000.0  # row 1: in group 2 (the bound then has that group's coarse scale); row 2 none
    exact = x.double() @ w.T

    _, scale = quantize(x, 256)
    assert scale.shape == (3, 4)
    bound = (scale.double() / 2) @ w.abs().view(n, 4, 256).sum(-1).T  # [3, n]
    bound += 1e-6 * (x.double().abs() @ w.abs().T)  # fp32 sums

    got = cpu.gguf_gemv(x, blocks, qtype, k).double()
    assert ((got - exact).abs() <= bound).all(), f"{_name(qtype)}: rounding error beyond the per-256 bound"
    # the same bound fails for one scale per row (the test can tell the groupings apart)
    xq_row, scale_row = quantize(x, k)
    y_row = (xq_row.double() * scale_row.double()) @ w.T
    assert not ((y_row - exact).abs() <= bound)[0].all(), "the test does not discriminate"


@pytest.mark.parametrize("qtype", sorted(K_QUANTS), ids=_name)
def test_cpp_gemv_k_quants_int32_sums_do_not_overflow(built, qtype):
    """The superblock's int32 sums at their worst: every weight and scale at its extreme, every
    activation at +-32767 after rounding (+-127 for Q4_K and Q6_K's int8, whose vpmaddubsw pairs
    must not saturate int16 either), the products all of one sign: the result is the float64
    product of the rounded activations and the weights (to fp32 rounding), no wrapped int32."""
    k, n = 512, 3
    blocks = extreme_blocks(qtype, n, k)
    w = reference.dequantize(blocks, qtype, k).double()
    assert (w == EXTREME_WEIGHT[qtype]).all(), f"{_name(qtype)}: the blocks are not at the extremes"
    x = torch.tensor([[1.0] * k, [-1.0] * k, [0.37] * 256 + [-2.5] * 256])
    xq, scale, _ = reference.round_activations(x, qtype)
    assert (xq.abs() == (127 if qtype in reference.INT8_ACT_TYPES else 32767)).all()
    want = (xq.double() * scale.double().repeat_interleave(256, dim=1)) @ w.T
    got = cpu.gguf_gemv(x, blocks, qtype, k).double()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("qtype", TYPES, ids=_name)
def test_cpp_gemv_rows_do_not_depend_on_their_batch(built, qtype):
    k = 512
    blocks = make_blocks(qtype, 37, k, seed=qtype)
    x = torch.randn(17, k, generator=torch.Generator().manual_seed(1))
    x[3] = 0  # an all-zero row
    bias = torch.randn(37)
    y = cpu.gguf_gemv(x, blocks, qtype, k, bias)
    for i in range(17):
        assert torch.equal(_bits(y[i]), _bits(cpu.gguf_gemv(x[i:i + 1], blocks, qtype, k, bias)[0])), i
    assert torch.equal(_bits(y[4:9]), _bits(cpu.gguf_gemv(x[4:9], blocks, qtype, k, bias)))
    assert torch.equal(y[3], bias)


# -- Q8_0 on AVX-512 VNNI: the int16 activations' dots by bytes in vpdpbusd ------------------------

Q8 = reference.Q8_0
VNNI512 = {"avx512f", "avx512bw", "avx512_vnni"}


def test_cpp_gemv_q8_0_kernel_is_this_cpus(built):
    """The build takes the AVX-512 VNNI kernel where the CPU has it (so the other Q8_0 tests here
    run it), else the AVX2 int16 kernel (the same integers)."""
    kernel = cpu.gemv_kernel(Q8)
    if VNNI512 <= cpu_flags():
        assert kernel == "int16 per 32 by bytes, vpdpbusd zmm (AVX-512 VNNI)"
    else:
        assert kernel.startswith("int16, vp"), kernel
    assert cpu.gemv_kernel(reference.Q4_1).startswith("int16")
    with pytest.raises(RuntimeError, match="unsupported qtype 1"):
        cpu.gemv_kernel(1)


def _q8_0_exact(x: torch.Tensor, blocks: torch.Tensor, k: int) -> torch.Tensor:
    """The reference's math in float64: the int16-rounded activations times the weights, exactly."""
    xq, scale, group = reference.round_activations(x, Q8)
    assert group == 32 and xq.dtype == torch.int16
    xd = xq.double() * scale.double().repeat_interleave(32, dim=1)
    return xd @ reference.dequantize(blocks, Q8, k).double().T


@pytest.mark.parametrize("k", [32, 96, 256, 352, 576, 1024])
def test_cpp_gemv_q8_0_is_the_int16_math_at_1_to_8_rows(built, k):
    """K of 1 block, 3, a whole group of 8, 11 (a group and 3), 18 (SmolLM2's 576), 32; every row
    count of a decode batch of up to 8 (and 9, 17), an odd and an even number of outputs: the
    float64 product of the int16-rounded activations, to fp32 summation, and each row bitwise the
    same alone and in any batch. The activations have outliers 30x the rest, as hidden states do."""
    n = 37
    blocks = make_blocks(Q8, n, k, seed=k)
    gen = torch.Generator().manual_seed(k)
    x = torch.randn(17, k, generator=gen)
    x[:, torch.randperm(k, generator=gen)[: max(1, k // 64)]] *= 30
    x[5] = 0  # an all-zero row
    bias = torch.randn(n, generator=gen)
    want = _q8_0_exact(x, blocks, k)
    slack = 1e-5 * (x.double().abs() @ reference.dequantize(blocks, Q8, k).double().abs().T)
    y = cpu.gguf_gemv(x, blocks, Q8, k)
    assert ((y.double() - want).abs() <= slack).all(), f"k={k}: beyond fp32 summation of the int8 math"
    assert torch.equal(cpu.gguf_gemv(x, blocks, Q8, k, bias), y + bias)
    for m in (*range(1, 9), 9, 17):
        for lo in (0, 17 - m):
            got = cpu.gguf_gemv(x[lo:lo + m], blocks, Q8, k)
            assert torch.equal(_bits(got), _bits(y[lo:lo + m])), f"k={k}: rows {lo}..{lo + m} differ from the 17-row call"
    assert (y[5] == 0).all()
    # int16's rounding error against the exact product (~2e-5), not int8's (~5e-3)
    exact = reference.gguf_matmul_exact(x, blocks, Q8, k).double()
    err = ((y.double() - exact).norm() / exact.norm()).item()
    assert err < 2e-4, f"k={k}: relative error {err:.3g}"
    odd = cpu.gguf_gemv(x, blocks[:36], Q8, k)  # weight rows in pairs, and one alone
    assert torch.equal(_bits(odd), _bits(y[:, :36].contiguous()))


def test_cpp_gemv_q8_0_at_the_extremes(built):
    """Weights at -128 and 127 (rows of each, and alternating), fp16 scales at 65504, 1, 2^-14 (the
    smallest normal) and 0, activations at +-32767 after rounding (both bytes of each at their
    extremes), beside blocks of tiny values and an outlier 1e4 times the rest: the float64 product
    of the rounded activations, no wrapped int32."""
    k, n = 352, 12
    q = np.zeros((n, k // 32, 32), dtype=np.int8)
    q[0::3], q[1::3] = -128, 127
    q[2::3] = np.where(np.arange(32) % 2, 127, -128).astype(np.int8)
    scales = np.array([65504.0, 1.0, 2.0 ** -14, 0.0], dtype=np.float16)
    d = np.resize(scales, (n, k // 32)).astype(np.float16)
    blocks = np.concatenate([d.view(np.uint8).reshape(n, k // 32, 2), q.view(np.uint8)], axis=-1).reshape(n, -1)
    blocks = torch.from_numpy(np.ascontiguousarray(blocks))
    w = reference.dequantize(blocks, Q8, k)
    assert w.max() == 127 * 65504.0 and w.min() == -128 * 65504.0 and w.abs()[w != 0].min() == 127 * 2.0 ** -14
    x = torch.stack([torch.ones(k), -torch.ones(k), torch.full((k,), 1e-3), torch.randn(k) * 1e-6,
                     torch.randn(k), torch.randn(k)])
    x[4, 7] = 1e4  # an outlier: its block rounds to 0 and +-127
    x[5, ::2] = -x[5, ::2].abs() - 1  # mixed signs, every block at +-127 somewhere
    xq, _, _ = reference.round_activations(x, Q8)
    assert (xq[:3].abs() == 32767).all()
    want = _q8_0_exact(x, blocks, k)
    slack = 1e-6 * (x.double().abs() @ w.double().abs().T) + 1e-30
    for m in (1, 6):
        got = cpu.gguf_gemv(x[:m], blocks, Q8, k).double()
        assert ((got - want[:m]).abs() <= slack[:m]).all(), f"{m} rows: {(got - want[:m]).abs().max()}"
    assert (cpu.gguf_gemv(x, blocks, Q8, k).double() - want).abs().le(slack).all()


def test_cpp_gemv_of_no_rows(built):
    blocks = make_blocks(reference.Q8_0, 5, 64)
    assert cpu.gguf_gemv(torch.zeros(0, 64), blocks, reference.Q8_0, 64).shape == (0, 5)


def test_cpp_ops_refuse_bad_inputs(built):
    q8, q4k = reference.Q8_0, reference.Q4_K
    blocks = make_blocks(q8, 4, 64)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="gguf_gemv: x must be fp32"):
        cpu.gguf_gemv(x.double(), blocks, q8, 64)
    with pytest.raises(RuntimeError, match=r"gguf_gemv: x must be \[M, k=64\]"):
        cpu.gguf_gemv(torch.randn(2, 96), blocks, q8, 64)
    with pytest.raises(RuntimeError, match="gguf_gemv: blocks must be uint8"):
        cpu.gguf_gemv(x, blocks.to(torch.int8), q8, 64)
    with pytest.raises(RuntimeError, match=r"gguf_gemv: blocks must be \[N, 68\]"):
        cpu.gguf_gemv(x, blocks[:, :60].contiguous(), q8, 64)
    with pytest.raises(RuntimeError, match="k=48 must be a positive multiple of the block of 32"):
        cpu.gguf_gemv(torch.randn(2, 48), blocks, q8, 48)
    with pytest.raises(RuntimeError, match="k=64 must be a positive multiple of the block of 256"):
        cpu.gguf_gemv(x, blocks, q4k, 64)
    with pytest.raises(RuntimeError, match="unsupported qtype 1"):
        cpu.gguf_gemv(x, blocks, 1, 64)
    with pytest.raises(RuntimeError, match="unsupported qtype 99"):
        cpu.dequantize(blocks, 99, 64)
    with pytest.raises(RuntimeError, match=r"gguf_gemv: bias must be contiguous fp32 \[N=4\]"):
        cpu.gguf_gemv(x, blocks, q8, 64, torch.zeros(3))
    with pytest.raises(RuntimeError, match="gguf_dequantize: row 4 out of range"):
        cpu.dequantize(blocks, q8, 64, torch.tensor([0, 4]))
    with pytest.raises(RuntimeError, match="gguf_dequantize: rows must be a CPU int64"):
        cpu.dequantize(blocks, q8, 64, torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="must be a positive multiple"):
        reference.dequantize(blocks, q4k, 64)
    with pytest.raises(ValueError, match="unsupported qtype"):
        reference.row_bytes(1, 64)


def test_cpp_ops_have_fake_shapes(built):
    """cpp_build registers the output shapes, so a compiled step calls the ops as extern kernels."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    blocks = make_blocks(reference.Q4_0, 6, 64)
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert cpu.gguf_gemv(torch.empty(3, 64), blocks, reference.Q4_0, 64).shape == (3, 6)
        assert cpu.dequantize(blocks, reference.Q4_0, 64).shape == (6, 64)
        assert cpu.dequantize(blocks, reference.Q4_0, 64, torch.zeros(2, dtype=torch.long)).shape == (2, 64)


@pytest.mark.slow
@pytest.mark.parametrize("march, needs", OTHER_ISAS, ids=["avx2", "avx512-without-vnni"])
def test_gemv_other_isa_paths(built, march, needs):
    """gguf_cpu.cpp built for an older ISA than this CPU's (AVX2's vpmaddwd + vpaddd where VNNI's
    vpdpwssd is, in the int16 dots and Q4_K / Q6_K's int8 ones), alone and in a process of its own
    (the ops' names are the main library's): the reference's math for every type, rows
    independent of their batch, the int32 sums at their extremes."""
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - cpu_flags())}")
    failed = other_isa_check(Path(cpu.__file__).with_name("gguf_cpu.cpp"), "gguf_gemv", march, ((1, 67), (3, 40), (8, 1)), extreme_rows=3)
    assert failed is None, failed
