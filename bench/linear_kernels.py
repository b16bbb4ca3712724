"""The linear layer's kernels on this CPU: fp32 GEMM peak, the prefill/decode shapes of a model, and
the int8 candidates side by side (in one run, so the ratios hold on a shared machine).

Prints, per shape ``[M, K] x [K, N]``: GFLOP/s and the fraction of this CPU's fp32 peak (the faster of
``torch.mm`` and a packed oneDNN product on large square matrices) for

* ``fp32 oneDNN``: layerzoo's fp32 linear (``mkldnn._linear_pointwise`` on a prepacked weight);
* ``fp32 mm``: ``x @ w.t()`` (MKL sgemm, repacks the weight every call);
* ``int8 (Q8_0 blocks)``: layerzoo's ``quantization="int8"`` (the GGUF block GEMV, or the dequantized product);
* with ``--all-int8``: torch's other int8 routes, ``_weight_int8pack_mm`` (weight-only) and
  ``_int_mm`` (int8 x int8 with per-row activation scales), which were slower here.

It never asserts timings. Examples::

    python bench/linear_kernels.py                     # Qwen3-0.6B shapes, 2 threads
    python bench/linear_kernels.py --threads 1 --rows 1,8,128,512 --all-int8
"""

from __future__ import annotations

import argparse
import os
import time


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rows", default="1,8,128,512", help="M values: decode batch sizes and prefill chunk lengths")
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--qkv", type=int, default=4096, help="fused q/k/v width (Qwen3-0.6B: (16 + 2 * 8) * 128)")
    p.add_argument("--peak-size", type=int, default=2048, help="square torch.mm size for the fp32 peak")
    p.add_argument("--all-int8", action="store_true", help="also time _weight_int8pack_mm and _int_mm")
    p.add_argument("--seconds", type=float, default=0.5, help="time per measurement (best of 3 batches)")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)

import torch  # noqa: E402
from cpu_flags import cpu_summary  # noqa: E402  (bench/ is sys.path[0] when run as a script)


def best_time(fn, seconds: float) -> float:
    """Best per-call seconds over 3 batches of calls that each take about ``seconds / 3``."""
    fn()
    t0 = time.perf_counter()
    fn()
    once = max(time.perf_counter() - t0, 1e-6)
    calls = max(1, int(seconds / 3 / once))
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def fp32_peak(n: int, seconds: float) -> tuple[float, float]:
    """GFLOP/s of a square fp32 product: ``torch.mm`` (MKL) and oneDNN with a packed weight. The
    larger is the peak: MKL reaches less than half of oneDNN's rate on some AMD CPUs (Zen 5)."""
    a, b = torch.randn(n, n), torch.randn(n, n)
    mm = 2 * n**3 / best_time(lambda: torch.mm(a, b), seconds) / 1e9
    packed = torch.ops.mkldnn._reorder_linear_weight(b, None)
    onednn = 2 * n**3 / best_time(lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], ""), seconds) / 1e9
    return mm, onednn


def candidates(w: torch.Tensor, all_int8: bool) -> dict:
    """name -> fn(x): the linear ``x @ w.t()`` by each route."""
    from layerzoo.layers import gguf_linear

    packed = torch.ops.mkldnn._reorder_linear_weight(w, None)
    q8 = gguf_linear.GGUFLinear(w.shape[1], w.shape[0], gguf_linear.Q8_0)
    q8.weight = torch.nn.Parameter(gguf_linear.quantize_q8_0(w), requires_grad=False)
    routes = {
        "fp32 oneDNN": lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "fp32 mm": lambda x: x @ w.t(),
        "int8 (Q8_0 blocks)": q8,
    }
    if all_int8:
        amax = w.abs().amax(1)
        scale = torch.where(amax > 0, amax / 127, torch.ones_like(amax))
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
        qt = q.t()

        def int_mm(x):
            s = x.abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
            xq = torch.round(x / s).to(torch.int8)
            rows = xq.shape[0]
            if rows <= 16:  # _int_mm wants more than 16 rows
                xq = torch.nn.functional.pad(xq, (0, 0, 0, 17 - rows))
            return torch._int_mm(xq, qt)[:rows] * s * scale

        routes["int8 _weight_int8pack_mm"] = lambda x: torch._weight_int8pack_mm(x, q, scale)
        routes["int8 _int_mm"] = int_mm
    return routes


def main(args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    print(cpu_summary())
    print(f"threads {torch.get_num_threads()} | torch {torch.__version__} | load avg {os.getloadavg()[0]:.2f} on "
          f"{os.cpu_count()} cores (shared machines: compare ratios within one run)")
    mm, onednn = fp32_peak(args.peak_size, args.seconds)
    peak = max(mm, onednn)
    print(f"fp32 peak ({args.peak_size}^3): {peak:.1f} GFLOP/s (torch.mm {mm:.1f}, oneDNN packed {onednn:.1f})")
    shapes = {"qkv": (args.qkv, args.hidden), "o_proj": (args.hidden, args.qkv // 2),
              "gate_up": (2 * args.intermediate, args.hidden), "down": (args.hidden, args.intermediate)}
    header = f"{'shape':8s} {'M':>5s} " + "".join(f"{'':2s}{name:>26s}" for name in candidates(torch.zeros(2, 2), args.all_int8))
    print(header + "   int8/fp32")
    for rows in (int(r) for r in args.rows.split(",")):
        for name, (n, k) in shapes.items():
            w = torch.randn(n, k) * 0.05
            x = torch.randn(rows, k)
            cells, times = [], {}
            for route, fn in candidates(w, args.all_int8).items():
                t = best_time(lambda: fn(x), args.seconds)
                times[route] = t
                gflops = 2 * rows * n * k / t / 1e9
                cells.append(f"{t * 1e3:8.3f} ms {gflops:6.1f} GF {gflops / peak:4.0%}")
            print(f"{name:8s} {rows:5d} " + "".join(f"  {c:>26s}" for c in cells)
                  + f"   {times['fp32 oneDNN'] / times['int8 fbgemm']:.2f}x", flush=True)


if __name__ == "__main__":
    main(ARGS)
