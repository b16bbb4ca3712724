"""The prepared check for a lent GPU: kernel tests compiled on CUDA, then op timings.

Nothing in CI runs it. Run it through ``bench/gpu_check.sh`` (about 5 minutes on an H200):

1. ``pytest tests/kernels`` with ``TRITON_INTERPRET=0`` and ``LAYERZOO_TEST_DEVICE=cuda``: the
   interpreter-tested kernels, compiled, on CUDA tensors (the tests' ``device`` fixture);
2. every registered op with a ``triton`` backend timed against its torch reference at realistic
   shapes (and against flashinfer / flash-attn for paged attention, when importable), with the
   relative RMS error of each output against the reference. Each op and peer runs in its own
   try/except: a failure becomes a row, not the end of the check.

Flags: ``--no-tests``, ``--no-bench``, ``--no-peers``, ``--budget S`` (seconds from the start
after which the remaining cases are skipped; 290), ``--json PATH`` (rows and test result as JSON),
``--smoke`` (the plumbing on CPU: interpreter, tiny shapes, no tests; for editing this script
on a machine without a GPU).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
START = time.perf_counter()


def out_of_time(budget_s: float) -> bool:
    return time.perf_counter() - START > budget_s


# -- part 1: the kernel tests, compiled --------------------------------------------------------


def run_tests(timeout_s: int) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "LAYERZOO_TEST_DEVICE": "cuda"}
    folders = ["tests/kernels"] + [f for f in ("plugins/ssm/tests/kernels",) if (ROOT / f).is_dir()]
    cmd = [sys.executable, "-m", "pytest", *folders, "-q", "-p", "no:cacheprovider", "--durations=5"]
    print(f"$ TRITON_INTERPRET=0 LAYERZOO_TEST_DEVICE=cuda {' '.join(cmd[1:])}", flush=True)
    start = time.perf_counter()
    try:
        rc = subprocess.run(cmd, cwd=ROOT, env=env, timeout=timeout_s).returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    wall = time.perf_counter() - start
    print(f"kernel tests: rc={rc} in {wall:.0f} s\n", flush=True)
    return {"rc": rc, "wall_s": round(wall, 1)}


# -- part 2: timings ---------------------------------------------------------------------------


@dataclass
class Case:
    """One op at one shape: the reference's arguments and the peers to time on the same inputs."""

    op: str
    label: str
    args: tuple
    nbytes: int | None = None  # bytes an ideal kernel moves (for GB/s), when meaningful
    kwargs: dict = field(default_factory=dict)  # keyword arguments of both the reference and the kernel
    # name -> setup(args) returning a zero-argument call; setup errors become rows
    peers: dict[str, Callable[[tuple], Callable[[], object]]] = field(default_factory=dict)


def paged_cache(torch, B, L, Hkv, D, bs, dtype, dev):
    """K/V caches holding ``B`` sequences of ``L`` tokens in shuffled blocks, and their tables."""
    per = math.ceil(L / bs)
    k = torch.randn(B * per, bs, Hkv, D, dtype=dtype, device=dev)
    v = torch.randn_like(k)
    tables = torch.randperm(B * per, device=dev).view(B, per)
    return k, v, tables, torch.full((B,), L, dtype=torch.int64, device=dev)


def contiguous_pages(torch, cache, tables, L, page):
    """The same sequences re-laid in ``page``-token pages (flash-attn 2 wants multiples of 256)."""
    B = tables.shape[0]
    seqs = cache[tables].flatten(1, 2)[:, :L]  # [B, L, Hkv, D]
    per = math.ceil(L / page)
    padded = torch.zeros(B, per * page, *cache.shape[2:], dtype=cache.dtype, device=cache.device)
    padded[:, :L] = seqs
    ids = torch.arange(B * per, dtype=torch.int32, device=cache.device).view(B, per)
    return padded.view(B * per, page, *cache.shape[2:]), ids


def flashinfer_plan(wrapper, *args, dtype, **kwargs):
    try:
        wrapper.plan(*args, q_data_type=dtype, kv_data_type=dtype, **kwargs)
    except TypeError:  # flashinfer < 0.2.1 takes one data_type
        wrapper.plan(*args, data_type=dtype, **kwargs)


def flashinfer_indices(torch, tables, lens, bs):
    pages = (lens + bs - 1) // bs
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=lens.device)
    indptr[1:] = pages.cumsum(0)
    indices = torch.cat([tables[b, : int(pages[b])] for b in range(len(lens))]).int()
    last = (lens - (pages - 1) * bs).int()
    return indptr, indices, last


def decode_case(torch, dev, dtype, small):
    B, Hq, Hkv, D, L, bs = (3, 4, 2, 32, 40, 16) if small else (32, 32, 8, 128, 2048, 16)
    k, v, tables, lens = paged_cache(torch, B, L, Hkv, D, bs, dtype, dev)
    q = torch.randn(B, Hq, D, dtype=dtype, device=dev)
    scale = D**-0.5

    def flashinfer(args):
        import flashinfer

        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(workspace, "NHD")
        indptr, indices, last = flashinfer_indices(torch, tables, lens, bs)
        flashinfer_plan(wrapper, indptr, indices, last, Hq, Hkv, D, bs, dtype=dtype, sm_scale=scale)
        return lambda: wrapper.run(q, (k, v))

    def flash_attn(args):
        from flash_attn import flash_attn_with_kvcache

        k2, ids = contiguous_pages(torch, k, tables, L, 256)
        v2, _ = contiguous_pages(torch, v, tables, L, 256)
        lens32 = lens.int()
        return lambda: flash_attn_with_kvcache(
            q[:, None], k2, v2, cache_seqlens=lens32, block_table=ids, softmax_scale=scale, causal=True
        )[:, 0]

    return Case(
        "paged_decode_attention", f"B={B} Hq={Hq} Hkv={Hkv} D={D} ctx={L} bs={bs}",
        (q, k, v, tables, lens, scale), nbytes=2 * k.numel() * k.element_size(),
        peers={"flashinfer": flashinfer, "flash-attn (page 256)": flash_attn},
    )


def prefill_case(torch, dev, dtype, small, prefix=0):
    B, n, Hq, Hkv, D, bs = (2, 20, 4, 2, 32, 16) if small else (4, 512, 32, 8, 128, 16)
    prefix = min(prefix, 8) if small else prefix
    L = prefix + n
    k, v, tables, lens = paged_cache(torch, B, L, Hkv, D, bs, dtype, dev)
    q = torch.randn(B * n, Hq, D, dtype=dtype, device=dev)
    starts = torch.arange(B + 1, device=dev) * n
    scale = D**-0.5

    def flashinfer(args):
        import flashinfer

        workspace = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD")
        indptr, indices, last = flashinfer_indices(torch, tables, lens, bs)
        flashinfer_plan(
            wrapper, starts.int(), indptr, indices, last, Hq, Hkv, D, bs, dtype=dtype, causal=True, sm_scale=scale
        )
        return lambda: wrapper.run(q, (k, v))

    def flash_attn(args):
        from flash_attn import flash_attn_varlen_func

        k2, ids = contiguous_pages(torch, k, tables, L, 256)
        v2, _ = contiguous_pages(torch, v, tables, L, 256)
        cu_q, cu_k = starts.int(), (torch.arange(B + 1, device=dev) * L).int()
        return lambda: flash_attn_varlen_func(
            q, k2, v2, cu_q, cu_k, n, L, softmax_scale=scale, causal=True, block_table=ids
        )

    label = f"{B}x{n} tokens{f' +{prefix} cached' if prefix else ''} Hq={Hq} Hkv={Hkv} D={D} bs={bs}"
    return Case(
        "paged_prefill_attention", label, (q, k, v, tables, starts, lens, scale),
        peers={"flashinfer": flashinfer, "flash-attn (page 256)": flash_attn},
    )


def elementwise_case(torch, dev, dtype, small, op):
    T, H, I, heads, D = (8, 64, 96, 2, 32) if small else (4096, 4096, 14336, 32, 128)

    def rand(*shape):
        return torch.randn(*shape, dtype=dtype, device=dev)

    size = torch.finfo(dtype).bits // 8
    if op == "rms_norm":  # reads x, residual; writes y, residual
        return Case(op, f"T={T} H={H} +residual", (rand(T, H), rand(H), 1e-6, rand(T, H)), nbytes=4 * T * H * size)
    if op == "rotary_embedding":
        x = rand(T, heads, D)
        return Case(op, f"T={T} heads={heads} D={D}", (x, rand(T, D), rand(T, D)), nbytes=2 * x.numel() * size)
    return Case(op, f"T={T} I={I}", (rand(T, I), rand(T, I)), nbytes=3 * T * I * size)


def fp8_case(torch, dev, dtype, small, op):
    T, Hkv, D = (8, 2, 32) if small else (16384, 8, 128)  # a step's K or V rows
    x = torch.randn(T, Hkv, D, dtype=dtype, device=dev)
    scale = torch.tensor(0.05, device=dev)
    label, nbytes = f"[{T}, {Hkv}, {D}]", x.numel() * (x.element_size() + 1)
    if op == "fp8_quantize":
        return Case(op, label, (x, scale), nbytes=nbytes)
    return Case(op, label, ((x.float() / scale).to(torch.float8_e4m3fn), scale, dtype), nbytes=nbytes)


def moe_case(torch, dev, dtype, small, op):
    T = 16 if small else 4096
    if op == "moe_softmax_topk":  # Qwen3-MoE: 128 experts, 8 per token
        E = 16 if small else 128
        return Case(op, f"T={T} E={E} k=8", (torch.randn(T, E, dtype=dtype, device=dev), 8, True))
    if op == "moe_sigmoid_grouped_topk":  # DeepSeek-V3: 256 experts in 8 groups
        E = 32 if small else 256
        logits, bias = torch.randn(T, E, dtype=dtype, device=dev), torch.randn(E, device=dev) * 0.1
        return Case(op, f"T={T} E={E} k=8 groups 4/8", (logits, bias, 8, 8, 4, True, 2.5))
    # moe_grouped_matmul at Qwen3-30B-A3B's expert shape
    T, E, H, I, k = (16, 8, 64, 32, 2) if small else (512, 128, 2048, 768, 8)
    x = torch.randn(T, H, dtype=dtype, device=dev)
    w13 = torch.randn(E, 2 * I, H, dtype=dtype, device=dev) * H**-0.5
    w2 = torch.randn(E, H, I, dtype=dtype, device=dev) * I**-0.5
    weights = torch.rand(T, k, device=dev)
    ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)])
    return Case(op, f"T={T} E={E} k={k} H={H} I={I}", (x, w13, w2, weights, ids))


def sampling_case(torch, dev, dtype, small, op):
    B, V = (4, 100) if small else (64, 151936)
    logits = torch.randn(B, V, device=dev)
    top_k = torch.randint(0, 64, (B,), device=dev)
    top_p = torch.rand(B, device=dev) * 0.5 + 0.5
    return Case(op, f"B={B} V={V}", (logits, top_k, top_p), nbytes=2 * logits.numel() * 4)


def delta_rule_case(torch, dev, dtype, small, op, per_key):
    """The delta rule at Qwen3-Next / Kimi Linear shapes (one long prompt, or a decode batch), with a
    decay per head (GDN) or per key channel (KDA)."""
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dtype)

    T, B = (130, 4) if small else (8192, 64)
    H, K, V = (2, 16, 16) if small else (32, 128, 128)
    n = T if op.endswith("chunk") else B
    cu = None if op.endswith("chunk") else torch.arange(B + 1, device=dev)
    g = -torch.rand(n, H, *((K,) if per_key else ()), device=dev) * 0.5
    state = torch.zeros((1 if cu is None else B), H, K, V, device=dev)
    args = (rand(n, H, K), rand(n, H, K), rand(n, H, V), g, torch.rand(n, H, device=dev))
    kwargs = dict(scale=K**-0.5, initial_state=state, cu_seqlens=cu)
    label = f"T={n} H={H} K={K} V={V} {'per-key' if per_key else 'per-head'}" + ("" if cu is None else " (decode)")
    return Case(op, label, args, kwargs=kwargs,
                nbytes=sum(a.numel() * a.element_size() for a in args) + 2 * state.numel() * 4)


def ssm_case(torch, dev, dtype, small, op):
    """The ssm plugin's ops at Qwen3-Next / Mamba2-2.7B shapes (one long prompt, or a decode batch)."""
    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dtype)

    T, B = (130, 4) if small else (8192, 64)
    if op.startswith("causal_conv1d"):
        D, W = (24, 4) if small else (8192, 4)
        weight = rand(D, W)
        if op == "causal_conv1d":
            x = rand(T, D)
            return Case(op, f"T={T} D={D} W={W}", (x, weight), kwargs=dict(conv_state=rand(1, D, W - 1)), nbytes=2 * x.numel() * x.element_size())
        x, state = rand(B, D), rand(B, D, W - 1)
        return Case(op, f"B={B} D={D} W={W}", (x, state, weight), nbytes=2 * state.numel() * state.element_size())
    H, P, G, N = (4, 8, 2, 16) if small else (80, 64, 1, 128)
    A = -torch.rand(H, device=dev) - 0.1
    if op == "mamba2_chunk_scan":
        x, dt = rand(T, H, P), torch.rand(T, H, device=dev) * 0.1
        args = (x, dt, A, rand(T, G, N), rand(T, G, N))
        return Case(op, f"T={T} H={H} P={P} N={N}", args, kwargs=dict(D=torch.ones(H, device=dev)), nbytes=2 * x.numel() * x.element_size())
    state = torch.randn(B, H, P, N, device=dev)
    args = (state, rand(B, H, P), torch.rand(B, H, device=dev) * 0.1, A, rand(B, G, N), rand(B, G, N))
    return Case(op, f"B={B} H={H} P={P} N={N}", args, kwargs=dict(D=torch.ones(H, device=dev)), nbytes=2 * state.numel() * 4)


SSM_OPS = ("causal_conv1d", "causal_conv1d_update",
           "mamba2_chunk_scan", "mamba2_state_update")


def backends_of(op):
    """``backend -> "module:function"`` of any registered op (the core's or a plugin's)."""
    from layerzoo.plugins.kernel_registry import kernel_ops
    from layerzoo.plugins.manager import get_registry

    return {backend: reg.target for backend, reg in kernel_ops(get_registry()).get(op, {}).items()}


def build_cases(torch, dev, dtype, small):
    """``(op, make)`` for every benchmark case; ``make()`` allocates its inputs."""
    yield "paged_decode_attention", lambda: decode_case(torch, dev, dtype, small)
    yield "paged_prefill_attention", lambda: prefill_case(torch, dev, dtype, small)
    yield "paged_prefill_attention", lambda: prefill_case(torch, dev, dtype, small, prefix=1536)
    for builder, ops in (
        (elementwise_case, ("rms_norm", "rotary_embedding", "silu_and_mul")),
        (fp8_case, ("fp8_quantize", "fp8_dequantize")),
        (moe_case, ("moe_softmax_topk", "moe_sigmoid_grouped_topk", "moe_grouped_matmul")),
        (sampling_case, ("top_k_top_p",)),
        (ssm_case, SSM_OPS if importlib.util.find_spec("layerzoo_ssm") else ()),
    ):
        for op in ops:
            yield op, lambda op=op, builder=builder: builder(torch, dev, dtype, small, op)
    for op in ("delta_rule_chunk", "delta_rule_recurrent"):
        for per_key in (False, True):
            yield op, lambda op=op, per_key=per_key: delta_rule_case(torch, dev, dtype, small, op, per_key)


def time_ms(torch, fn, cuda, warmup=5, iters=30) -> float:
    """Median milliseconds of ``fn()``: CUDA events per call on a GPU, perf_counter on CPU."""
    for _ in range(warmup):
        fn()
    if not cuda:
        samples = []
        for _ in range(iters):
            start = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - start) * 1e3)
        return statistics.median(samples)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(iters)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def rel_err(torch, ref, out) -> float:
    """Relative RMS error over the finite values, plus the fraction of values finite in only one
    (e.g. filtered logits); the largest over the outputs when an op returns several."""
    refs = ref if isinstance(ref, (tuple, list)) else (ref,)
    outs = out if isinstance(out, (tuple, list)) else (out,)
    errs = []
    for r, o in zip(refs, outs):
        r, o = r.double(), o.double()
        both = r.isfinite() & o.isfinite()
        odd = float((r.isfinite() != o.isfinite()).double().mean())
        r, o = r[both], o[both]
        errs.append(float((o - r).pow(2).mean().sqrt() / r.pow(2).mean().sqrt().clamp_min(1e-12)) + odd)
    return max(errs)


def bench_case(torch, case: Case, cuda: bool, iters: int, peers: bool, budget_s: float) -> list[dict]:
    from layerzoo.plugins.manager import resolve_object

    backends = backends_of(case.op)
    rows = []

    def row(impl, ms=None, ref_ms=None, err=None, note=""):
        gbps = case.nbytes / ms / 1e6 if case.nbytes and ms else None
        speedup = ref_ms / ms if ref_ms and ms else None
        rows.append({"op": case.op, "case": case.label, "impl": impl, "ms": ms, "speedup_vs_torch": speedup,
                     "err_vs_torch": err, "gb_s": gbps, "note": note})
        print(format_row(rows[-1]), flush=True)

    ref_fn = resolve_object(backends["torch"])
    ref_out = ref_fn(*case.args, **case.kwargs)
    ref_ms = time_ms(torch, lambda: ref_fn(*case.args, **case.kwargs), cuda, iters=iters)
    row("torch", ref_ms, ref_ms, 0.0)

    def triton(args):
        fn = resolve_object(backends["triton"])
        return lambda: fn(*args, **case.kwargs)

    impls = {"triton": triton, **(case.peers if peers else {})}
    for name, setup in impls.items():
        if out_of_time(budget_s):
            row(name, note="skipped: out of the time budget")
            continue
        try:
            call = setup(case.args)
            err = rel_err(torch, ref_out, call())
            row(name, time_ms(torch, call, cuda, iters=iters), ref_ms, err)
        except ImportError as exc:
            row(name, note=f"not importable ({exc.name or exc})")
        except Exception as exc:  # noqa: BLE001 - a failing impl is a row, not the end
            row(name, note=f"{type(exc).__name__}: {str(exc).splitlines()[0][:90] if str(exc) else ''}")
            traceback.print_exc(limit=3)
    return rows


def fmt(value, spec):
    return "-" if value is None else format(value, spec)


HEADER = f"{'op':<24} {'case':<44} {'impl':<22} {'ms':>9} {'vs torch':>9} {'err':>9} {'GB/s':>7}  note"


def format_row(r: dict) -> str:
    speed = "-" if r["speedup_vs_torch"] is None else f"{r['speedup_vs_torch']:.2f}x"
    return (f"{r['op']:<24} {r['case']:<44} {r['impl']:<22} {fmt(r['ms'], '9.3f')} {speed:>9} "
            f"{fmt(r['err_vs_torch'], '9.1e')} {fmt(r['gb_s'], '7.0f')}  {r['note']}")


def run_bench(smoke: bool, peers: bool, budget_s: float) -> list[dict]:
    import torch

    cuda = not smoke
    if cuda and not torch.cuda.is_available():
        print("no CUDA device: skipping the timings (use --smoke to exercise them on CPU)")
        return []
    dev, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    torch.manual_seed(0)
    print(f"timings: {torch.cuda.get_device_name() if cuda else 'cpu (smoke)'}, {dtype}, torch {torch.__version__}")
    print(HEADER, flush=True)
    rows = []
    for op, make in build_cases(torch, dev, dtype, small=smoke):
        if "triton" not in backends_of(op):
            continue  # only ops with a Triton kernel are timed
        if out_of_time(budget_s):
            print(f"{op}: skipped, out of the time budget ({budget_s:.0f} s)")
            continue
        case = None
        try:
            case = make()
            rows += bench_case(torch, case, cuda, 3 if smoke else 30, peers, budget_s)
        except Exception as exc:  # noqa: BLE001
            rows.append({"op": op, "case": case.label if case else "?", "impl": "-", "ms": None,
                         "speedup_vs_torch": None, "err_vs_torch": None, "gb_s": None,
                         "note": f"case failed: {type(exc).__name__}: {exc}"[:160]})
            print(format_row(rows[-1]), flush=True)
            traceback.print_exc(limit=3)
        finally:
            del case
            if cuda:
                torch.cuda.empty_cache()
    untimed = [op for op in _ops_with_triton() if op not in {r["op"] for r in rows}]
    if untimed:
        print(f"ops with a triton backend but no benchmark case: {', '.join(untimed)}")
    print("\n" + HEADER)
    for r in rows:
        print(format_row(r))
    return rows


def _ops_with_triton() -> list[str]:
    from layerzoo.plugins.kernel_registry import kernel_ops
    from layerzoo.plugins.manager import get_registry

    return [op for op, regs in kernel_ops(get_registry()).items() if "triton" in regs]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--no-tests", action="store_true", help="skip pytest tests/kernels on CUDA")
    parser.add_argument("--no-bench", action="store_true", help="skip the timings")
    parser.add_argument("--test-timeout", type=int, default=200, help="seconds for the kernel tests (200)")
    parser.add_argument("--json", type=Path, help="write the test result and timing rows here")
    parser.add_argument("--no-peers", action="store_true", help="skip flashinfer / flash-attn")
    parser.add_argument("--budget", type=float, default=290, help="seconds from start after which "
                        "remaining cases are skipped (290; a case already running finishes)")
    parser.add_argument("--smoke", action="store_true", help="CPU, interpreter, tiny shapes, no tests")
    args = parser.parse_args(argv)
    # read when a kernel module is imported, so before any triton kernel is
    os.environ["TRITON_INTERPRET"] = "1" if args.smoke else "0"
    report = {"tests": None, "rows": []}
    if not (args.no_tests or args.smoke):
        report["tests"] = run_tests(args.test_timeout)
    if not args.no_bench:
        report["rows"] = run_bench(args.smoke, not args.no_peers, args.budget)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    tests_ok = report["tests"] is None or report["tests"]["rc"] == 0
    return 0 if tests_ok else 1


if __name__ == "__main__":
    if importlib.util.find_spec("layerzoo") is None:
        sys.exit("layerzoo is not importable: run with the project's venv (pip install -e .)")
    sys.exit(main())
