"""The GGUF block GEMV (``layerzoo.kernels.gguf_matmul``, C++ ``gguf_gemv``) against ``F.linear``
on the dequantized fp32 weight, in one run, in turns (so the ratios hold on a shared machine).

Prints, per type, shape ``(N, K)`` and rows ``M``: the GEMV's time (the median over the turns,
each turn the mean of ``--calls`` calls: other processes on a shared machine make single turns
noisy) and the GB/s of GGUF weight bytes it streams, the fp32 linear's time, and their ratio (> 1:
the GEMV is faster). The weights are random blocks with sane fp16 scales; K-quants skip shapes
whose K is not a multiple of 256. The fp32 weights of these shapes (2-12 MB) may sit in the cache
between turns; the GGUF ones (0.5-3.5 MB) too. It never asserts timings. Examples::

    python bench/gguf_gemv.py
    python bench/gguf_gemv.py --threads 1 --types Q4_0,Q6_K --rows 1,2,4,8 --shapes 1024x1024
    python bench/gguf_gemv.py --baseline HEAD~3 --types Q4_K,Q6_K --shapes 1024x1024,3072x1024

``--baseline REV`` also builds ``gguf_cpu.cpp`` as it was at git revision ``REV`` (alone, its ops
renamed into their own namespace) and times it in the same turns: before/after on one machine.
``--clock cpu`` (with ``--threads 1``, where the ops run in the calling thread) times the thread's
CPU time instead of the wall clock: time slices taken by other processes on a busy shared machine
then do not count (their cache traffic still does).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from layerzoo.kernels import cpp_build
from layerzoo.kernels.gguf_matmul import cpu, reference

SHAPES = "1536x576,576x1536,1024x1024,3072x1024,1024x3072"  # N x K: SmolLM2-135M's, Qwen3-0.6B's
FP16_FIELDS = {reference.Q4_0: [0], reference.Q4_1: [0, 2], reference.Q5_0: [0], reference.Q5_1: [0, 2],
               reference.Q8_0: [0], reference.Q2_K: [80, 82], reference.Q3_K: [108], reference.Q4_K: [0, 2],
               reference.Q5_K: [0, 2], reference.Q6_K: [208]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--types", default="Q4_0,Q4_1,Q8_0,Q4_K,Q6_K", help=f"of {','.join(reference.NAMES.values())}")
    p.add_argument("--rows", default="1,4", help="M values")
    p.add_argument("--shapes", default=SHAPES, help="weight shapes NxK, comma-separated")
    p.add_argument("--turns", type=int, default=7, help="alternating turns; the median turn is reported")
    p.add_argument("--calls", type=int, default=30, help="calls per batch")
    p.add_argument("--baseline", metavar="REV", help="also time gguf_cpu.cpp as of this git revision, in turns")
    p.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="cpu: this thread's CPU time (--threads 1)")
    args = p.parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        p.error(f"--clock cpu times the calling thread only: it needs --threads 1, got --threads {args.threads}")
    return args


def random_blocks(qtype: int, n: int, k: int, rng: np.random.Generator) -> torch.Tensor:
    elems, nbytes = reference.SIZES[qtype]
    data = rng.integers(0, 256, (n, k // elems, nbytes), dtype=np.uint8)
    for off in FP16_FIELDS[qtype]:
        data[..., off:off + 2] = rng.uniform(0.001, 0.05, (n, k // elems)).astype(np.float16).view(np.uint8).reshape(
            n, k // elems, 2)
    return torch.from_numpy(data.reshape(n, -1))


def baseline_gemv(rev: str):
    """``gguf_gemv`` of ``kernels/gguf_matmul/gguf_cpu.cpp`` at git revision ``rev``, built alone
    with the kernels' flags, its ops in a namespace of their own (beside the current ones)."""
    from torch.utils import cpp_extension

    root = Path(__file__).resolve().parent.parent

    def at_rev(name: str) -> str | None:
        shown = subprocess.run(["git", "-C", str(root), "show", f"{rev}:kernels/gguf_matmul/{name}"],
                               capture_output=True, text=True)
        return shown.stdout if shown.returncode == 0 else None

    src = at_rev("gguf_cpu.cpp")
    if src is None:
        raise SystemExit(f"--baseline {rev}: no kernels/gguf_matmul/gguf_cpu.cpp at that revision")
    header = at_rev("gguf_blocks.h") or ""  # what it shares with the GEMM, since that revision's successors
    ns = f"gguf_base_{hashlib.sha256((src + header).encode()).hexdigest()[:10]}"
    folder = Path(tempfile.gettempdir()) / ns  # the source beside its own revision's header
    folder.mkdir(exist_ok=True)
    if header:
        (folder / "gguf_blocks.h").write_text(header)
    path = folder / f"{ns}.cpp"
    path.write_text(src.replace("layerzoo_cpu", ns))
    cpp_extension.load(name=ns, sources=[str(path)], extra_cflags=cpp_build.CFLAGS, extra_ldflags=["-fopenmp"],
                       extra_include_paths=[str(Path(cpp_build.__file__).parent / "gguf_matmul")],
                       is_python_module=False, verbose=False)
    return getattr(torch.ops, ns).gguf_gemv


def per_call(fn, calls: int, clock=time.perf_counter) -> float:
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"cpu capability {torch.backends.cpu.get_cpu_capability()}, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {args.clock} clock, load avg {os.getloadavg()[0]:.1f}")
    if not cpp_build.available():
        print(f"the C++ kernels are not built: {cpp_build.why_unavailable()}")
        return
    by_name = {v: k for k, v in reference.NAMES.items()}
    types = [by_name[t.strip()] for t in args.types.split(",")]
    rows = [int(r) for r in args.rows.split(",")]
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    base = baseline_gemv(args.baseline) if args.baseline else None
    rng = np.random.default_rng(0)
    head = f"{'type':5} {'N':>5} {'K':>5} {'M':>3} | {'gguf_gemv us':>12} {'GB/s':>6} | {'fp32 F.linear us':>16} | ratio"
    print(head + (f" | {args.baseline + ' us':>12} {'GB/s':>6} | speedup" if base else ""))
    for qtype in types:
        elems = reference.SIZES[qtype][0]
        for n, k in (tuple(int(v) for v in shape.split("x")) for shape in args.shapes.split(",")):
            if k % elems:
                print(f"{reference.NAMES[qtype]:5} {n:5} {k:5}   - | K not a multiple of {elems}")
                continue
            blocks = random_blocks(qtype, n, k, rng)
            w = reference.dequantize(blocks, qtype, k)
            for m in rows:
                x = torch.randn(m, k)
                fns = [lambda: cpu.gguf_gemv(x, blocks, qtype, k), lambda: F.linear(x, w)]
                if base:
                    fns.append(lambda: base(x, blocks, qtype, k, None))
                for fn in fns:
                    fn()
                turns = [[] for _ in fns]
                for _ in range(args.turns):
                    for i, fn in enumerate(fns):
                        turns[i].append(per_call(fn, args.calls, clock))
                g, lin, *was = (statistics.median(t) for t in turns)
                line = (f"{reference.NAMES[qtype]:5} {n:5} {k:5} {m:3} | {g * 1e6:12.1f} {blocks.numel() / g / 1e9:6.1f} | "
                        f"{lin * 1e6:16.1f} | {lin / g:5.2f}")
                if was:
                    line += f" | {was[0] * 1e6:12.1f} {blocks.numel() / was[0] / 1e9:6.1f} | {was[0] / g:7.2f}"
                print(line, flush=True)


if __name__ == "__main__":
    main()
