"""Test helpers: GGUF weight blocks (``[N, row_bytes]`` uint8, as in a file) for the block kernels'
tests, realistic ones and ones at the formats' integer extremes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import torch

from layerzoo.kernels.gguf_matmul import reference

# byte offsets of the fp16 scale fields in a block (set to sane values in random blocks)
FP16_FIELDS = {reference.Q4_0: [0], reference.Q4_1: [0, 2], reference.Q5_0: [0], reference.Q5_1: [0, 2],
               reference.Q8_0: [0], reference.Q2_K: [80, 82], reference.Q3_K: [108], reference.Q4_K: [0, 2],
               reference.Q5_K: [0, 2], reference.Q6_K: [208]}
K_QUANTS = frozenset({reference.Q2_K, reference.Q3_K, reference.Q4_K, reference.Q5_K, reference.Q6_K})


def make_blocks(qtype: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """Realistic blocks ``[n, row_bytes]``: the gguf package's quantization of a normal weight where
    it can quantize the type, else random bytes with fp16 scales uniform in [0.001, 0.05]."""
    from gguf import quants
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(seed)
    try:
        data = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), GGMLQuantizationType(qtype))
    except NotImplementedError:
        elems, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        data = rng.integers(0, 256, (n, k // elems, nbytes), dtype=np.uint8)
        for off in FP16_FIELDS[qtype]:
            scales = rng.uniform(0.001, 0.05, (n, k // elems)).astype(np.float16)
            data[..., off:off + 2] = scales.view(np.uint8).reshape(n, k // elems, 2)
        data = data.reshape(n, -1)
    return torch.from_numpy(np.ascontiguousarray(data))


# the largest |weight| each type's extreme blocks hold (d = 1, no mins): the integer the kernels multiply
EXTREME_WEIGHT = {reference.Q4_K: 945, reference.Q5_K: 1953, reference.Q6_K: 4096, reference.Q3_K: 128,
                  reference.Q2_K: 45, reference.Q8_0: 128, reference.Q4_0: 8, reference.Q5_0: 16}


def extreme_blocks(qtype: int, n: int, k: int) -> torch.Tensor:
    """Blocks whose every weight and sub-block scale is at the format's extreme, all of one sign
    (d = 1, no mins): Q4_K q 15 x sc 63, Q5_K 31 x 63, Q6_K (q - 32) -32 x sc -128, Q3_K q -4 x
    sc -32, Q2_K 3 x 15; Q8_0 -128, Q4_0 -8, Q5_0 -16 (`EXTREME_WEIGHT`)."""
    nbytes = reference.SIZES[qtype][1]
    b = np.zeros(nbytes, dtype=np.uint8)
    one = np.frombuffer(np.float16(1.0).tobytes(), dtype=np.uint8)
    if qtype in (reference.Q4_K, reference.Q5_K):  # d, dmin 0, scales: sc 63 and m 0 for all 8, qs all 15
        b[0:2] = one
        b[4:8], b[8:12], b[12:16] = 0xFF, 0x00, 0x0F
        b[16:] = 0xFF  # Q5_K: qh all 1 too
    elif qtype == reference.Q6_K:  # ql, qh 0 (q - 32 = -32), scales -128, d
        b[192:208] = 0x80
        b[208:210] = one
    elif qtype == reference.Q3_K:  # hmask 0 and low bits 0 (q = -4), 6-bit scales 0 (sc = -32), d
        b[108:110] = one
    elif qtype == reference.Q2_K:  # scales 15 with min 0, q 3, d, dmin 0
        b[0:16], b[16:80] = 0x0F, 0xFF
        b[80:82] = one
    elif qtype == reference.Q8_0:  # q -128
        b[0:2], b[2:] = one, 0x80
    elif qtype in (reference.Q4_0, reference.Q5_0):  # q 0: -8 (Q4_0), -16 (Q5_0: qh 0)
        b[0:2] = one
    else:
        raise ValueError(f"no extreme blocks for {reference.NAMES.get(qtype, qtype)}")
    return torch.from_numpy(np.tile(b, (n, k // reference.SIZES[qtype][0])))


# -- the block kernels built for an older ISA than this CPU's -------------------------------------

# (march, the CPU flags it needs): AVX2 (vpmaddwd + vpaddd where VNNI's vpdpwssd is) and AVX-512
# without VNNI; the main build takes this CPU's own path.
OTHER_ISAS = (("haswell", frozenset({"avx2", "fma", "f16c"})), ("skylake-avx512", frozenset({"avx512f", "avx512bw", "avx512vl"})))

# Run by `other_isa_check` in a process of its own (the op's name is the main library's):
# argv = source, march, op, JSON [row shapes, rows of the extremes check].
_OTHER_ISA_SCRIPT = """
import hashlib, json, sys
from pathlib import Path
import torch
from torch.utils import cpp_extension
source, march, op = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
shapes, extreme_rows = json.loads(sys.argv[4])
digest = hashlib.sha256(source.read_bytes() + source.with_name("gguf_blocks.h").read_bytes() + march.encode()
                        + torch.__version__.encode()).hexdigest()[:12]
cpp_extension.load(name=f"layerzoo_{op}_{march.replace('-', '_')}_{digest}", sources=[str(source)],
                   extra_cflags=["-O2", f"-march={march}", "-fopenmp", "-ffp-contract=off"],
                   extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
from layerzoo.kernels.gguf_matmul import reference
from layerzoo.testing.gguf_blocks import EXTREME_WEIGHT, K_QUANTS, extreme_blocks, make_blocks
kernel = getattr(torch.ops.layerzoo_cpu, op)
g = torch.Generator().manual_seed(0)
for qtype in sorted(reference.SUPPORTED_TYPES):
    k = 768 if qtype in K_QUANTS else 352
    for m, n in shapes:
        blocks, x, bias = make_blocks(qtype, n, k, seed=m + qtype), torch.randn(m, k, generator=g), torch.randn(n, generator=g)
        want = reference.gguf_matmul(x, blocks, qtype, k, bias)
        torch.testing.assert_close(kernel(x, blocks, qtype, k, bias), want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    y = kernel(x, blocks, qtype, k, None)
    assert all(torch.equal(y[i], kernel(x[i:i + 1], blocks, qtype, k, None)[0]) for i in range(len(x)))
for qtype in sorted(EXTREME_WEIGHT):
    blocks = extreme_blocks(qtype, 35, 512)
    x = torch.cat([torch.ones(1, 512), -torch.ones(1, 512), torch.ones(extreme_rows, 512)])
    xq, scale, group = reference.round_activations(x, qtype)
    want = (xq.double() * scale.double().repeat_interleave(group, dim=1)) @ reference.dequantize(blocks, qtype, 512).double().T
    torch.testing.assert_close(kernel(x, blocks, qtype, 512, None).double(), want, rtol=1e-6, atol=0)
print(op, "ok", march)
"""


def cpu_flags() -> set[str]:
    """This CPU's flags (/proc/cpuinfo; empty where there is none)."""
    path = Path("/proc/cpuinfo")
    for line in path.read_text().splitlines() if path.exists() else ():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def other_isa_check(source: Path, op: str, march: str, shapes, extreme_rows: int) -> str | None:
    """Build ``source`` (a block kernel's C++ file, op ``op``) for ``march`` in a process of its own
    and check it there: the reference's math for every type at ``shapes`` (``[(rows, outputs)]``),
    rows independent of their batch, the integer sums at their extremes over ``2 + extreme_rows``
    rows. None when it passed, else what the process said."""
    run = subprocess.run([sys.executable, "-c", _OTHER_ISA_SCRIPT, str(source), march, op, json.dumps([shapes, extreme_rows])],
                         capture_output=True, text=True, timeout=900)
    return None if run.returncode == 0 and f"{op} ok {march}" in run.stdout else run.stderr[-3000:] or run.stdout[-3000:]
