"""The C++ decode GEMV (``layerzoo.kernels.cpu_gemv``) against its plain-torch reference: odd
row counts (tails of the 4-row weight tiles and of the 1-4 activation-row chunks), lengths that
are not a multiple of the vector width, bias or none, and inputs it must refuse."""

from __future__ import annotations

import shutil

import pytest
import torch

from layerzoo.kernels.cpu_gemv import cpu, reference

# Wherever a compiler is present the kernel must build: a silent fallback would hide a broken build.
if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler: the kernel cannot be built here", allow_module_level=True)


def test_the_kernel_builds_here():
    assert cpu.available(), cpu.why_unavailable()


SHAPES = [(1, 1, 1), (1, 5, 7), (2, 4, 16), (3, 37, 17), (4, 130, 100), (5, 9, 259), (8, 64, 64), (9, 33, 1000)]


@pytest.mark.parametrize("M,N,K", SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_int8_gemv_matches_reference(M, N, K, bias):
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    x = torch.randn(M, K, generator=g)
    q = torch.randint(-127, 128, (N, K), generator=g, dtype=torch.int8)
    scale = torch.rand(N, generator=g) * 0.02 + 1e-3
    b = torch.randn(N, generator=g) if bias else None
    out = cpu.int8_gemv(x, q, scale, b)
    ref = reference.int8_gemv(x, q, scale, b)
    assert out.shape == (M, N) and out.dtype == torch.float32
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * K ** 0.5)


@pytest.mark.parametrize("M,N,K", SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in SHAPES])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_f32_gemv_matches_reference(M, N, K, bias):
    g = torch.Generator().manual_seed(M * 1000 + N + K + 1)
    x, w = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    torch.testing.assert_close(cpu.f32_gemv(x, w, b), reference.f32_gemv(x, w, b), rtol=1e-5, atol=1e-5 * K ** 0.5)


def test_rows_are_independent():
    """Each activation row's result is the same alone or beside others (no shared scale, unlike
    fbgemm's dynamic quantization): a decode row does not depend on its batch."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(7, 96, generator=g)
    x[3] *= 1000  # an outlier row
    q = torch.randint(-127, 128, (21, 96), generator=g, dtype=torch.int8)
    scale = torch.rand(21, generator=g)
    together = cpu.int8_gemv(x, q, scale, None)
    for i in range(7):
        assert torch.equal(together[i], cpu.int8_gemv(x[i : i + 1].contiguous(), q, scale, None)[0])


def test_bad_inputs_are_refused_by_name():
    x, q, scale = torch.randn(2, 8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(4)
    with pytest.raises(RuntimeError, match="q must be int8"):
        cpu.int8_gemv(x, q.float(), scale, None)
    with pytest.raises(RuntimeError, match=r"x \[M, K\] and w \[N, K\]"):
        cpu.int8_gemv(torch.randn(2, 9), q, scale, None)
    with pytest.raises(RuntimeError, match="scale must be contiguous fp32"):
        cpu.int8_gemv(x, q, torch.ones(3), None)
    with pytest.raises(RuntimeError, match="x must be contiguous fp32"):
        cpu.f32_gemv(x.double(), q.float(), None)
