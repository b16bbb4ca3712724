"""Test helpers: GGUF weight blocks (``[N, row_bytes]`` uint8, as in a file) for the block kernels'
tests, realistic ones and ones at the formats' integer extremes."""

from __future__ import annotations

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
