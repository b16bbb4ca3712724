"""The GGUF block GEMM (``gguf_gemm``, many activation rows: prefill, batched decode) against the
reference's math (``reference.gguf_matmul``: activations rounded to int16 per group, or to int8 per
superblock for Q4_K and Q6_K, times the dequantized weight) for every type on odd shapes (rows 9, 17, 33, 100 and the micro-kernel's row
tails; outputs not a multiple of its 32-row tile; K of a partial chunk), close to the GEMV; its
int32 sums exact with every weight, scale and activation at its extreme; each row's output bitwise
independent of the rows beside it; and, built apart in a process of its own, the AVX2 path and the
AVX-512 path without VNNI (this CPU's own build takes the AVX-512 VNNI one)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from layerzoo.kernels import cpp_build
from layerzoo.kernels.gguf_matmul import cpu, reference
from layerzoo.testing.gguf_blocks import (
    EXTREME_WEIGHT,
    K_QUANTS,
    OTHER_ISAS,
    cpu_flags,
    extreme_blocks,
    make_blocks,
    other_isa_check,
)

pytest.importorskip("gguf.quants")

TYPES = sorted(reference.SUPPORTED_TYPES)


def _name(qtype: int) -> str:
    return reference.NAMES[qtype]


@pytest.fixture(scope="module")
def built():
    if not cpp_build.available():
        pytest.skip(f"the C++ kernels are not built here: {cpp_build.why_unavailable()}")
    return True


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _ks(qtype: int) -> list[int]:
    """K: one superblock, several; the 32-element formats also 3 blocks and 11 (a chunk of 8 + 3)."""
    return [256, 768] if qtype in K_QUANTS else [96, 352, 512]


@pytest.mark.parametrize("qtype", TYPES, ids=_name)
def test_gemm_is_the_references_math(built, qtype):
    gen = torch.Generator().manual_seed(qtype)
    for k in _ks(qtype):
        for n in (67, 1, 40):
            blocks = make_blocks(qtype, n, k, seed=n * k + qtype)
            bias = torch.randn(n, generator=gen)
            for m in (9, 17, 33, 100, 1, 5):
                x = torch.randn(m, k, generator=gen)
                for b in (None, bias):
                    got = cpu.gguf_gemm(x, blocks, qtype, k, b)
                    want = reference.gguf_matmul(x, blocks, qtype, k, b)
                    assert got.shape == (m, n) and got.dtype == torch.float32
                    scale = want.abs().max().item()
                    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * scale,
                                               msg=lambda s: f"{_name(qtype)} m={m} n={n} k={k} bias={b is not None}: {s}")
        # the GEMV computes the same (up to fp32 summation order)
        blocks = make_blocks(qtype, 37, k, seed=qtype)
        x = torch.randn(12, k, generator=gen)
        gemv = cpu.gguf_gemv(x, blocks, qtype, k)
        torch.testing.assert_close(cpu.gguf_gemm(x, blocks, qtype, k), gemv, rtol=1e-4, atol=1e-5 * gemv.abs().max().item())


@pytest.mark.parametrize("qtype", sorted(EXTREME_WEIGHT), ids=_name)
def test_gemm_int32_sums_do_not_overflow(built, qtype):
    """Every weight and sub-block scale at its extreme, every activation at +-32767 after rounding
    (+-127 for Q4_K and Q6_K's int8: their vpmaddubsw pairs must not saturate without VNNI either),
    all products of one sign: the float64 product of the rounded activations and the weights (to
    fp32 rounding), no wrapped int32 (each format's run of exact int32 sums is at its longest)."""
    k, n = 512, 35
    blocks = extreme_blocks(qtype, n, k)
    w = reference.dequantize(blocks, qtype, k).double()
    assert (w.abs() == EXTREME_WEIGHT[qtype]).all(), f"{_name(qtype)}: the blocks are not at the extremes"
    x = torch.cat([torch.ones(1, k), -torch.ones(1, k), torch.tensor([[0.37] * 256 + [-2.5] * 256]), torch.ones(7, k)])
    xq, scale, group = reference.round_activations(x, qtype)
    assert (xq.abs() == (127 if qtype in reference.INT8_ACT_TYPES else 32767)).all()
    want = (xq.double() * scale.double().repeat_interleave(group, dim=1)) @ w.T
    got = cpu.gguf_gemm(x, blocks, qtype, k).double()
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)


@pytest.mark.parametrize("qtype", TYPES, ids=_name)
def test_gemm_rows_do_not_depend_on_their_batch(built, qtype):
    k = 512
    blocks = make_blocks(qtype, 45, k, seed=qtype)
    x = torch.randn(23, k, generator=torch.Generator().manual_seed(1))
    x[3] = 0  # an all-zero row
    bias = torch.randn(45)
    y = cpu.gguf_gemm(x, blocks, qtype, k, bias)
    for i in range(23):
        assert torch.equal(_bits(y[i]), _bits(cpu.gguf_gemm(x[i:i + 1], blocks, qtype, k, bias)[0])), i
    for lo, hi in ((4, 13), (1, 8), (9, 23)):
        assert torch.equal(_bits(y[lo:hi]), _bits(cpu.gguf_gemm(x[lo:hi], blocks, qtype, k, bias))), (lo, hi)
    assert torch.equal(y[3], bias)


def test_gemm_of_no_rows_and_bad_inputs(built):
    q8 = reference.Q8_0
    blocks = make_blocks(q8, 5, 64)
    assert cpu.gguf_gemm(torch.zeros(0, 64), blocks, q8, 64).shape == (0, 5)
    x = torch.randn(2, 64)
    with pytest.raises(RuntimeError, match="gguf_gemm: x must be fp32"):
        cpu.gguf_gemm(x.double(), blocks, q8, 64)
    with pytest.raises(RuntimeError, match=r"gguf_gemm: x must be \[M, k=64\]"):
        cpu.gguf_gemm(torch.randn(2, 96), blocks, q8, 64)
    with pytest.raises(RuntimeError, match=r"gguf_gemm: blocks must be \[N, 68\]"):
        cpu.gguf_gemm(x, blocks[:, :60].contiguous(), q8, 64)
    with pytest.raises(RuntimeError, match="gguf_gemm: unsupported qtype 1"):
        cpu.gguf_gemm(x, blocks, 1, 64)
    with pytest.raises(RuntimeError, match=r"gguf_gemm: bias must be contiguous fp32 \[N=5\]"):
        cpu.gguf_gemm(x, blocks, q8, 64, torch.zeros(3))


def test_gemm_has_a_fake_shape(built):
    """cpp_build registers the output shape, so a compiled step calls the op as an extern kernel."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    blocks = make_blocks(reference.Q4_0, 6, 64)
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert cpu.gguf_gemm(torch.empty(30, 64), blocks, reference.Q4_0, 64).shape == (30, 6)


@pytest.mark.slow
@pytest.mark.parametrize("march, needs", OTHER_ISAS, ids=["avx2", "avx512-without-vnni"])
def test_gemm_other_isa_paths(built, march, needs):
    """gguf_gemm_cpu.cpp built for an older ISA than this CPU's (its AVX2 path, or AVX-512 without
    VNNI's vpdpwssd), alone and in a process of its own (the ops' names are the main library's):
    the reference's math, rows independent of their batch, the int32 sums at their extremes."""
    if not needs <= cpu_flags():
        pytest.skip(f"this CPU lacks {sorted(needs - cpu_flags())}")
    failed = other_isa_check(Path(cpu.__file__).with_name("gguf_gemm_cpu.cpp"), "gguf_gemm", march, ((9, 67), (17, 40), (33, 1)), extreme_rows=7)
    assert failed is None, failed
