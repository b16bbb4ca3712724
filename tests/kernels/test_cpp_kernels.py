"""The C++ CPU kernels (``layerzoo.kernels.cpp_build``) against their plain-torch references: the
packed decode GEMVs on odd row counts and lengths that are not a multiple of the vector width; paged decode attention on ragged
contexts over shuffled block tables (GQA, an empty context); RMSNorm with and without the
residual; inputs they must refuse; and the registry choosing them for CPU tensors."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels import cpp_build
from layerzoo.kernels.cpu_gemv import cpu, reference
from layerzoo.kernels.paged_attention import cpp as attn_cpp
from layerzoo.kernels.paged_attention import reference as attn_ref
from layerzoo.kernels.rms_norm import cpp as norm_cpp
from layerzoo.kernels.rms_norm import reference as norm_ref
from layerzoo.kernels.rotary import cpp as rotary_cpp
from layerzoo.kernels.rotary import reference as rotary_ref
from layerzoo.kernels.silu_and_mul import cpp as act_cpp
from layerzoo.kernels.silu_and_mul import reference as act_ref

# Wherever a compiler is present the kernel must build: a silent fallback would hide a broken build.
if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler: the kernel cannot be built here", allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def _library_loaded():
    """The tests call the ops directly: build or load the library first, whichever test runs alone."""
    assert cpp_build.available(), cpp_build.why_unavailable()


def test_every_header_the_sources_include_is_part_of_the_builds_name():
    """The build is cached by a hash of what it reads: a header missing from HEADERS would leave a
    stale library loaded after the header changed."""
    import re

    files = [*cpp_build.SOURCES, *cpp_build.HEADERS]
    included = {(path.parent / name).resolve() for path in files
                for name in re.findall(r'#include "([^"]+)"', path.read_text())}
    assert included <= {h.resolve() for h in cpp_build.HEADERS}, sorted(map(str, included))


def test_an_install_missing_a_source_leaves_the_kernels_off_with_its_name(monkeypatch, tmp_path):
    """A wheel that left a source out (package data) must not raise from every op's first line:
    the build says which file is missing and the ops stay on torch."""
    monkeypatch.setattr(cpp_build, "SOURCES", [*cpp_build.SOURCES, tmp_path / "gone_cpu.cpp"])
    monkeypatch.setattr(cpp_build, "_state", {})  # _build records how it ended: not in the loaded library's record
    ok, why = cpp_build._build()
    assert not ok and "gone_cpu.cpp" in why, why


def test_another_march_is_another_build():
    """LAYERZOO_CPU_MARCH builds the kernels for another CPU (e.g. AVX2 paths on an AVX-512 host):
    its flag reaches the compiler and the build's cached name, so the two builds never load each
    other's library."""
    import subprocess
    import sys

    code = "from layerzoo.kernels import cpp_build as b; print(b.CFLAGS[1], b._build_name())"
    lines = [subprocess.run([sys.executable, "-c", code], env={**os.environ, "LAYERZOO_CPU_MARCH": march},
                            capture_output=True, text=True, check=True).stdout.split() for march in ("haswell", "")]
    assert lines[0][0] == "-march=haswell" and lines[1][0] == "-march=native"  # (empty: the default)
    assert lines[0][1] != lines[1][1]


def test_the_kernels_build_here():
    assert cpp_build.available(), cpp_build.why_unavailable()
    assert cpu.available()


def avx512() -> bool:
    return torch.backends.cpu.get_cpu_capability().startswith("AVX512")


PACKED_SHAPES = [(1, 64, 16), (2, 65, 17), (3, 130, 100), (4, 200, 48), (5, 7, 5), (7, 90, 80), (13, 70, 33),
                 (16, 1000, 259), (32, 129, 100)]


@pytest.mark.skipif(not avx512(), reason="oneDNN's packed layout that the kernel reads is its AVX-512 one")
@pytest.mark.parametrize("M,N,K", PACKED_SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in PACKED_SHAPES])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_packed_fp32_gemv_reads_onednns_layout(M, N, K, bias):
    """Odd shapes: outputs past a block of 64, inputs past a tile of 16 (oneDNN pads both)."""
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    w, x = torch.randn(N, K, generator=g), torch.randn(M, K, generator=g)
    b = torch.randn(N, generator=g) if bias else None
    out = cpu.packed_fp32_gemv(x, torch.ops.mkldnn._reorder_linear_weight(w, None), b)
    assert out.shape == (M, N)
    torch.testing.assert_close(out, reference.packed_fp32_gemv(x, w, b), rtol=1e-5, atol=1e-5 * K**0.5)


@pytest.mark.skipif(not avx512(), reason="oneDNN's packed layout that the kernel reads is its AVX-512 one")
def test_packed_fp32_gemv_refuses_a_buffer_in_another_layout():
    """oneDNN keeps a [1, 1] weight as 4 plain bytes: read as AB16b64a tiles the kernel would run
    4 KB past the buffer (garbage, NaN seen after a fresh build); it refuses instead."""
    packed = torch.ops.mkldnn._reorder_linear_weight(torch.randn(1, 1), None)
    assert torch.ops.mkldnn._nbytes(packed) == 4
    with pytest.raises(RuntimeError, match="holds 4 bytes, not the 4096"):
        cpu.packed_fp32_gemv(torch.randn(1, 1), packed, None)


@pytest.mark.skipif(not avx512(), reason="oneDNN's packed layout that the kernel reads is its AVX-512 one")
def test_packed_fp32_gemv_rows_are_independent():
    g = torch.Generator().manual_seed(5)
    w, x = torch.randn(150, 70, generator=g), torch.randn(32, 70, generator=g)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    together = cpu.packed_fp32_gemv(x, packed, None)
    for i in range(32):  # every place in a group of six, and the last, short group
        assert torch.equal(together[i], cpu.packed_fp32_gemv(x[i : i + 1], packed, None)[0])
    assert torch.equal(together[:13], cpu.packed_fp32_gemv(x[:13], packed, None))


def avx512_bf16() -> bool:
    """oneDNN packs bf16 here and the bf16 kernel's vdpbf16ps is built (-march=native)."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return "avx512_bf16" in flags and torch.ops.mkldnn._is_mkldnn_bf16_supported()


@pytest.fixture(scope="module")
def bf16_block():
    """This CPU's packed bf16 block: 64 outputs (AB16b64a2b), or 32 (AB16b32a2b) where it has AMX."""
    block = cpu.bf16_packed_block()
    assert block in (64, 32), "oneDNN packs bf16 here in a layout the kernel does not read"
    return block


BF16_SHAPES = PACKED_SHAPES + [(6, 64, 32), (1, 3, 1000), (2, 96, 40), (3, 33, 64)]


@pytest.mark.skipif(not avx512_bf16(), reason="oneDNN's packed bf16 layout that the kernel reads is its AVX-512 BF16 one")
@pytest.mark.parametrize("M,N,K", BF16_SHAPES, ids=[f"M{m}-N{n}-K{k}" for m, n, k in BF16_SHAPES])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_packed_bf16_gemv_reads_onednns_layout(M, N, K, bias, bf16_block):
    """Outputs past a block of 64 (or 32), inputs past a pair and past the layout's 32: the exact
    product of the bf16 values rounded once to bf16, bar sums that land on a rounding boundary (one
    bf16 step)."""
    g = torch.Generator().manual_seed(M * 1000 + N + K)
    w, x = torch.randn(N, K, generator=g).bfloat16(), torch.randn(M, K, generator=g).bfloat16()
    b = torch.randn(N, generator=g).bfloat16() if bias else None
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    out = cpu.packed_bf16_gemv(x, packed, b, bf16_block)
    exact = reference.packed_bf16_gemv(x, w, b)
    assert out.shape == (M, N) and out.dtype == torch.bfloat16
    step = exact.float().abs().clamp_min(1e-3) * 2**-7  # one bf16 step at each output's size
    assert bool(((out.float() - exact.float()).abs() <= step).all())
    assert (out == exact).float().mean() > 0.95


@pytest.mark.skipif(not avx512_bf16(), reason="oneDNN's packed bf16 layout that the kernel reads is its AVX-512 BF16 one")
def test_packed_bf16_gemv_rows_are_independent_and_sizes_are_checked(bf16_block):
    g = torch.Generator().manual_seed(6)
    w, x = torch.randn(150, 70, generator=g).bfloat16(), torch.randn(32, 70, generator=g).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    together = cpu.packed_bf16_gemv(x, packed, None, bf16_block)
    for i in range(32):
        assert torch.equal(together[i], cpu.packed_bf16_gemv(x[i : i + 1], packed, None, bf16_block)[0])
    n, k = packed.shape
    want = {64: 36864, 32: 30720}[bf16_block]  # 150 outputs in whole blocks, 70 inputs padded to 96
    with pytest.raises(RuntimeError, match=f"not the {want} of the AB16b{bf16_block}a2b layout"):
        torch.ops.layerzoo_cpu.packed_bf16_gemv(x, torch.ops.mkldnn.data_ptr(packed), n, k, None, 4096, bf16_block)
    with pytest.raises(RuntimeError, match="block must be 64 .* or 32"):
        torch.ops.layerzoo_cpu.packed_bf16_gemv(x, torch.ops.mkldnn.data_ptr(packed), n, k, None, want, 16)
    with pytest.raises(RuntimeError, match="contiguous bf16 x"):
        cpu.packed_bf16_gemv(x.float(), packed, None, bf16_block)


@pytest.mark.skipif(not avx512_bf16(), reason="oneDNN's packed bf16 layout that the kernel reads is its AVX-512 BF16 one")
def test_the_probe_tells_the_layouts_apart(bf16_block):
    """Where the outputs fill whole 64s both layouts have one size; read with the other block the
    product is wrong, so the layout probe (and a layer's check at load) must pick this CPU's."""
    g = torch.Generator().manual_seed(7)
    w, x = torch.randn(128, 64, generator=g).bfloat16(), torch.randn(1, 64, generator=g).bfloat16()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    exact = reference.packed_bf16_gemv(x, w, None)
    other = 96 - bf16_block  # 32 <-> 64
    assert torch.allclose(cpu.packed_bf16_gemv(x, packed, None, bf16_block).float(), exact.float(), rtol=1e-2, atol=1e-2)
    assert not torch.allclose(cpu.packed_bf16_gemv(x, packed, None, other).float(), exact.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("hq,hkv,d", [(4, 4, 16), (6, 2, 20), (8, 1, 64)], ids=["mha", "gqa3-d20", "mqa-d64"])
def test_paged_decode_attention_matches_reference(hq, hkv, d):
    g = torch.Generator().manual_seed(hq * 100 + d)
    block_size, blocks = 4, 64
    lens = torch.tensor([1, 7, 0, 13, 33])  # one empty context
    width = 10
    k_cache = torch.randn(blocks, block_size, hkv, d, generator=g)
    v_cache = torch.randn(blocks, block_size, hkv, d, generator=g)
    tables = torch.randperm(blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    q = torch.randn(len(lens), hq, d, generator=g)
    out = attn_cpp.paged_decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5)
    live = lens > 0
    ref = attn_ref.paged_decode_attention(q[live], k_cache, v_cache, tables[live], lens[live], d ** -0.5)
    torch.testing.assert_close(out[live], ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))


@pytest.mark.parametrize("d", [64, 128, 24])
def test_paged_decode_attention_long_contexts_and_wide_scores(d):
    """The vector softmax (exp by polynomial) and the four-tokens-at-a-time value sums, past
    every tail: contexts of 1-301 tokens, scores spread over tens of units so that most weights
    underflow toward 0 and a few dominate."""
    g = torch.Generator().manual_seed(d)
    hq, hkv, block_size, blocks = 8, 2, 16, 160
    lens = torch.tensor([301, 1, 15, 16, 17, 250, 63])
    width = 20
    k_cache = torch.randn(blocks, block_size, hkv, d, generator=g)
    v_cache = torch.randn(blocks, block_size, hkv, d, generator=g)
    tables = torch.randperm(blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    for spread in (1.0, 12.0):
        q = torch.randn(len(lens), hq, d, generator=g) * spread
        out = attn_cpp.paged_decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5)
        ref = attn_ref.paged_decode_attention(q.double(), k_cache.double(), v_cache.double(), tables, lens, d ** -0.5)
        torch.testing.assert_close(out, ref.float(), rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("d", [64, 24], ids=["d64", "d24"])
def test_row_queries_of_one_sequence_attend_together_as_they_would_alone(d, dtype):
    """Rows that share a block table with lengths L, L + 1, ... (a verify's rows, a short chunk's)
    are one task of the kernel, which reads each key block once for all of them: each row's output
    is bitwise what it is alone, and matches the reference. Runs of 1, 5 and 19 rows (past a task's
    8), lengths off every vector and four-token boundary, an empty-context row, and two runs of one
    table whose lengths do not continue each other."""
    g = torch.Generator().manual_seed(d + 7)
    hq, hkv, block_size, blocks, width = 4, 2, 16, 96, 24
    k_cache = torch.randn(blocks, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(blocks, block_size, hkv, d, generator=g).to(dtype)
    tables = torch.randperm(blocks, generator=g)[: 4 * width].view(4, width)
    runs = [(0, 30, 1), (1, 13, 5), (2, 0, 1), (3, 341, 19), (1, 2, 3), (0, 31, 1)]  # (table, first length, rows)
    row_tables = torch.cat([tables[t].expand(n, width) for t, _, n in runs])
    lens = torch.tensor([first + i for _, first, n in runs for i in range(n)])
    q = (torch.randn(len(lens), hq, d, generator=g) * 3).to(dtype)
    out = attn_cpp.paged_decode_attention(q, k_cache, v_cache, row_tables, lens, d ** -0.5)
    for i in range(len(lens)):
        alone = attn_cpp.paged_decode_attention(q[i : i + 1], k_cache, v_cache, row_tables[i : i + 1], lens[i : i + 1], d ** -0.5)
        assert torch.equal(out[i : i + 1], alone), i
    live = lens > 0
    ref = attn_ref.paged_decode_attention(q[live].double(), k_cache.double(), v_cache.double(), row_tables[live], lens[live], d ** -0.5)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[live].double(), ref, rtol=tol, atol=tol)
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))


def test_short_chunks_attend_as_decode_rows():
    """Speculative verifies and short continuations: each chunk's rows see their own prefix."""
    from layerzoo.errors import KernelUnsupported

    g = torch.Generator().manual_seed(5)
    hq, hkv, d, block_size, blocks = 6, 2, 16, 4, 64
    k_cache = torch.randn(blocks, block_size, hkv, d, generator=g)
    v_cache = torch.randn(blocks, block_size, hkv, d, generator=g)
    counts, lens = [3, 1, 5, 16], torch.tensor([9, 4, 5, 30])  # one chunk is a whole 5-token prompt
    tables = torch.randperm(blocks, generator=g)[:32].view(4, 8)
    query_start = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()])
    q = torch.randn(sum(counts), hq, d, generator=g)
    out = attn_cpp.paged_prefill_attention(q, k_cache, v_cache, tables, query_start, lens, 0.25)
    ref = attn_ref.paged_prefill_attention(q, k_cache, v_cache, tables, query_start, lens, 0.25)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(KernelUnsupported, match="more than 16 rows"):
        attn_cpp.paged_prefill_attention(torch.randn(17, hq, d), k_cache, v_cache, tables[:1],
                                         torch.tensor([0, 17]), torch.tensor([20]), 0.25)


def test_paged_decode_attention_refuses_other_dtypes():
    from layerzoo.errors import KernelUnsupported

    q, cache = torch.randn(1, 2, 8).half(), torch.randn(2, 4, 2, 8).half()
    tables, lens = torch.zeros(1, 2, dtype=torch.long), torch.tensor([3])
    with pytest.raises(KernelUnsupported, match="fp32 or bf16"):
        attn_cpp.paged_decode_attention(q, cache, cache, tables, lens, 1.0)
    with pytest.raises(KernelUnsupported, match="one dtype"):
        attn_cpp.paged_decode_attention(q.float(), cache.bfloat16(), cache.bfloat16(), tables, lens, 1.0)


@pytest.mark.parametrize("d", [64, 24])
def test_paged_decode_attention_in_bf16(d):
    """A bf16 cache read in place and summed in fp32: the float64 result of the same bf16 values,
    rounded once to bf16 (within one bf16 step), on tails of the token vectors and an empty context."""
    g = torch.Generator().manual_seed(d + 1)
    hq, hkv, block_size, blocks = 6, 2, 16, 64
    lens = torch.tensor([37, 1, 0, 16, 120])
    k_cache = torch.randn(blocks, block_size, hkv, d, generator=g).bfloat16()
    v_cache = torch.randn(blocks, block_size, hkv, d, generator=g).bfloat16()
    tables = torch.randperm(blocks, generator=g)[:40].view(len(lens), 8)
    q = (torch.randn(len(lens), hq, d, generator=g) * 4).bfloat16()
    out = attn_cpp.paged_decode_attention(q, k_cache, v_cache, tables, lens, d ** -0.5)
    assert out.dtype == torch.bfloat16
    live = lens > 0
    exact = attn_ref.paged_decode_attention(q[live].double(), k_cache.double(), v_cache.double(), tables[live], lens[live], d ** -0.5)
    err = (out[live].double() - exact).abs()
    assert bool((err <= exact.abs() * 2**-8 + 1e-6).all()), float(err.max())
    assert torch.equal(out[~live], torch.zeros_like(out[~live]))


@pytest.mark.parametrize("shape", [(1, 5), (3, 16), (2, 7, 33), (65, 1024)], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_reference(shape, residual):
    g = torch.Generator().manual_seed(len(shape) + shape[-1])
    x, w = torch.randn(*shape, generator=g), torch.randn(shape[-1], generator=g)
    r = torch.randn(*shape, generator=g) if residual else None
    y, summed = norm_cpp.rms_norm(x, w, 1e-6, r)
    y_ref, summed_ref = norm_ref.rms_norm(x, w, 1e-6, r)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(summed, summed_ref, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(1, 5), (3, 16), (65, 1024)], ids=str)
@pytest.mark.parametrize("residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_in_bf16_matches_reference(shape, residual):
    """bf16 rows normalized in fp32 and rounded where the reference rounds: the residual sum bitwise,
    the output within one bf16 step (the reference's rsqrt and sum order differ by an fp32 ulp)."""
    g = torch.Generator().manual_seed(shape[-1] + 3)
    x, w = torch.randn(*shape, generator=g).bfloat16(), torch.randn(shape[-1], generator=g).bfloat16()
    r = torch.randn(*shape, generator=g).bfloat16() if residual else None
    y, summed = norm_cpp.rms_norm(x, w, 1e-6, r)
    y_ref, summed_ref = norm_ref.rms_norm(x, w, 1e-6, r)
    assert y.dtype == summed.dtype == torch.bfloat16
    assert torch.equal(summed, summed_ref)
    assert bool(((y.float() - y_ref.float()).abs() <= y_ref.float().abs() * 2**-7 + 1e-30).all())
    assert (y == y_ref).float().mean() > 0.98
    with pytest.raises(KernelUnsupported, match="one dtype"):
        norm_cpp.rms_norm(x, w.float(), 1e-6, r)


ROTARY_SHAPES = [(1, 1, 8, 8), (5, 4, 64, 64), (3, 6, 128, 128), (7, 2, 64, 48), (4, 3, 40, 20), (2, 2, 66, 34)]


@pytest.mark.parametrize("t,h,d,r", ROTARY_SHAPES, ids=[f"T{t}-H{h}-D{d}-R{r}" for t, h, d, r in ROTARY_SHAPES])
def test_rotary_is_bitwise_the_reference(t, h, d, r):
    """Full and partial rotary, halves past and short of a vector, q read in place from a fused
    qkv row (a token stride wider than the heads): the same bits as the torch reference."""
    g = torch.Generator().manual_seed(t * h + d + r)
    qkv = torch.randn(t, 3 * h * d, generator=g) * 3
    q = qkv[:, h * d : 2 * h * d].view(t, h, d)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    cos, sin = rotary_ref.cos_sin(inv_freq, torch.arange(t) * 37 + 5, 1.0, torch.float32)
    out = rotary_cpp.apply_rotary(q, cos, sin)
    assert out.is_contiguous() and torch.equal(out, rotary_ref.apply_rotary(q, cos, sin))


def test_rotary_leaves_other_layouts_to_the_reference():
    x, cos = torch.randn(2, 1, 8), torch.randn(2, 8)
    with pytest.raises(KernelUnsupported, match="not interleaved"):
        rotary_cpp.apply_rotary(x, cos, cos, interleaved=True)
    with pytest.raises(KernelUnsupported, match="fp32 or bf16"):
        rotary_cpp.apply_rotary(x.half(), cos.half(), cos.half())
    with pytest.raises(KernelUnsupported, match="one dtype"):
        rotary_cpp.apply_rotary(x.bfloat16(), cos, cos)


@pytest.mark.parametrize("t,h,d,r", ROTARY_SHAPES, ids=[f"T{t}-H{h}-D{d}-R{r}" for t, h, d, r in ROTARY_SHAPES])
def test_rotary_in_bf16_matches_reference(t, h, d, r):
    """bf16 q read in place, rounded where the reference's mul and addcmul round: within one bf16
    step of it (addcmul's own sum may round once differently), the pass-through part bitwise."""
    g = torch.Generator().manual_seed(t * h + d + r + 1)
    qkv = (torch.randn(t, 3 * h * d, generator=g) * 3).bfloat16()
    q = qkv[:, h * d : 2 * h * d].view(t, h, d)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    cos, sin = rotary_ref.cos_sin(inv_freq, torch.arange(t) * 37 + 5, 1.0, torch.bfloat16)
    out, ref = rotary_cpp.apply_rotary(q, cos, sin), rotary_ref.apply_rotary(q, cos, sin)
    assert out.dtype == torch.bfloat16 and out.is_contiguous()
    assert bool(((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 2**-10).all())
    assert (out == ref).float().mean() > 0.97
    assert torch.equal(out[..., r:], q[..., r:])


@pytest.mark.parametrize("t,i", [(1, 1), (3, 16), (5, 300), (64, 3072), (2, 17)], ids=str)
def test_silu_and_mul_matches_reference(t, i):
    """The halves of a fused gate_up row (a row stride of 2I), wide gate values (exp's range)."""
    g = torch.Generator().manual_seed(t + i)
    gate_up = torch.randn(t, 2 * i, generator=g) * 8
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(act_cpp.silu_and_mul(gate, up), act_ref.silu_and_mul(gate, up), rtol=1e-6, atol=1e-6)
    gb, ub = gate.bfloat16(), up.bfloat16()  # strided halves of a bf16 row
    out, ref = act_cpp.silu_and_mul(gb, ub), act_ref.silu_and_mul(gb, ub)
    assert out.dtype == torch.bfloat16
    assert bool(((out.float() - ref.float()).abs() <= ref.float().abs() * 2**-7 + 1e-30).all())
    with pytest.raises(KernelUnsupported, match="fp32 or bf16"):
        act_cpp.silu_and_mul(gate.half(), up.half())


def test_the_registry_runs_them_for_cpu_tensors_and_as_extern_calls_in_a_compiled_step():
    """A compiled decode step calls the C++ ops themselves (their shapes are registered), where it
    used to trace the torch references; a CPU backend that registers no shapes still falls back."""
    from layerzoo.plugins.kernel_registry import BACKEND_ENV, KernelOp
    from layerzoo.plugins.ops import kernel

    op = kernel("rms_norm")
    assert op.choose("cpu")[0] == "cpp" and op.choose("cuda")[0] != "cpp"
    x, w = torch.randn(2, 8), torch.randn(8)
    op(x, w, 1e-6, None)  # resolves the backends, as an engine's eager steps do before a compile
    graphs = []

    def backend(gm, example_inputs):
        graphs.append({str(node.target) for node in gm.graph.nodes if node.op == "call_function"})
        return gm

    compiled = torch.compile(lambda a: op(a, w, 1e-6, None)[0], fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x), norm_ref.rms_norm(x, w, 1e-6)[0])
    assert "layerzoo_cpu.rms_norm.default" in graphs[0], graphs

    other = KernelOp("rms_norm", {"torch": "layerzoo.kernels.rms_norm.reference:rms_norm",
                                  "mine": "layerzoo.kernels.rms_norm.cpp:rms_norm"}, env={BACKEND_ENV: "mine"})
    other(x, w, 1e-6, None)
    graphs.clear()
    compiled = torch.compile(lambda a: other(a, w, 1e-6, None)[0], fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x), norm_ref.rms_norm(x, w, 1e-6)[0])
    assert not any("layerzoo_cpu" in target for target in graphs[0]), graphs  # traced the reference
