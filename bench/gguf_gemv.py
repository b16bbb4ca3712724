"""The GGUF block GEMV (``layerzoo.kernels.gguf_matmul``, C++ ``gguf_gemv``) against ``F.linear``
on the dequantized fp32 weight, in one run, in turns (so the ratios hold on a shared machine).

Prints, per type, shape ``(N, K)`` and rows ``M``: the GEMV's time and the GB/s of GGUF weight bytes
it streams, the fp32 linear's time, and their ratio (> 1: the GEMV is faster). The weights are
random blocks with sane fp16 scales; K-quants skip shapes whose K is not a multiple of 256. The
fp32 weights of these shapes (2-12 MB) may sit in the cache between turns; the GGUF ones
(0.5-3.5 MB) too. It never asserts timings. Examples::

    python bench/gguf_gemv.py
    python bench/gguf_gemv.py --threads 1 --types Q4_0,Q6_K --rows 1,2,4,8
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from layerzoo.kernels import cpp_build
from layerzoo.kernels.gguf_matmul import cpu, reference

SHAPES = [(1536, 576), (576, 1536), (3072, 1024), (1024, 3072)]
FP16_FIELDS = {reference.Q4_0: [0], reference.Q4_1: [0, 2], reference.Q5_0: [0], reference.Q5_1: [0, 2],
               reference.Q8_0: [0], reference.Q2_K: [80, 82], reference.Q3_K: [108], reference.Q4_K: [0, 2],
               reference.Q5_K: [0, 2], reference.Q6_K: [208]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q6_K", help=f"of {','.join(reference.NAMES.values())}")
    p.add_argument("--rows", default="1,4", help="M values")
    p.add_argument("--turns", type=int, default=7, help="alternating turns; each reports its best batch")
    p.add_argument("--calls", type=int, default=30, help="calls per batch")
    return p.parse_args(argv)


def random_blocks(qtype: int, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    elems, nbytes = reference.SIZES[qtype]
    data = rng.integers(0, 256, (n, k // elems, nbytes), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        data[..., off:off + 2] = rng.uniform(0.001, 0.05, (n, k // elems)).astype(np.float16).view(np.uint8).reshape(
            n, k // elems, 2)
    return torch.from_numpy(data.reshape(n, -1))


def per_call(fn, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}")
    if not cpp_build.available():
        print(f"the C++ kernels are not built: {cpp_build.why_unavailable()}")
        return
    by_name = {v: k for k, v in reference.NAMES.items()}
    types = [by_name[t.strip()] for t in args.types.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    rng = np.random.default_rng(0)
    print(f"{'type':5} {'N':>5} {'K':>5} {'M':>3} | {'gguf_gemv us':>12} {'GB/s':>6} | {'fp32 F.linear us':>16} | ratio")
    for qtype in types:
        elems = reference.SIZES[qtype][0]
        for n, k in SHAPES:
            if k % elems:
                print(f"{reference.NAMES[qtype]:5} {n:5} {k:5}   - | K not a multiple of {elems}")
                continue
            blocks = random_blocks(qtype, n, k, rng)
            w = reference.dequantize(blocks, qtype, k)
            for m in rows:
                x = torch.randn(m, k)
                fns = [lambda: cpu.gguf_gemv(x, blocks, qtype, k), lambda: F.linear(x, w)]
                for fn in fns:
                    fn()
                best = [float("inf"), float("inf")]
                for _ in range(args.turns):
                    for i, fn in enumerate(fns):
                        best[i] = min(best[i], per_call(fn, args.calls))
                g, lin = best
                print(f"{reference.NAMES[qtype]:5} {n:5} {k:5} {m:3} | {g * 1e6:12.1f} {blocks.numel() / g / 1e9:6.1f} | "
                      f"{lin * 1e6:16.1f} | {lin / g:5.2f}")


if __name__ == "__main__":
    main()
