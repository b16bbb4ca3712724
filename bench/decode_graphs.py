"""Compiled vs eager decode on CPU: does a ``torch.compile``'d decode step (``compile_decode=True``)
pay for itself? Both engines run in the same process on the same model and requests, alternating,
and the script prints each one's time per decode step, their ratio and whether their greedy tokens
agree. It never asserts a timing. With ``--device cuda`` (run by ``bench/gpu_check.sh``) the peers
are CUDA-graph decode (the default there) and ``enforce_eager=True``.

Models: the embedded demo model (``core/embedded/tiny-qwen3-stdlib``, 4 layers, hidden 256) and a
bigger random Qwen3 (``--big``, a throughput.py preset, cached under ``bench/.cache``)::

    python bench/decode_graphs.py                         # batch 1 and 4, both models
    python bench/decode_graphs.py --batch 1 2 8 --steps 48 --rounds 5
    python bench/decode_graphs.py --big none              # the embedded model only
    python bench/decode_graphs.py --threads 1             # on a shared, loaded machine
    python bench/decode_graphs.py --device cuda --dtype bfloat16 --hybrid tiny   # CUDA graphs

The first round of each batch size is a warm-up (it compiles: one graph per batch bucket and
block-table width) and is reported as compile time, not timed with the rest.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4], help="decode batch sizes (default: 1 4)")
    p.add_argument("--prompt-len", type=int, default=40, help="prompt tokens per request (default 40)")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per round (default 32)")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per engine and batch size (default 3)")
    p.add_argument("--big", default="small", help="throughput.py preset for the bigger Qwen3 (tiny, small, 0.6b) or 'none'")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads (default: all cores)")
    p.add_argument("--device", default="cpu", help="cpu (compiled step) or cuda (CUDA graphs)")
    p.add_argument("--dtype", default="float32", help="run dtype (default float32)")
    p.add_argument("--hybrid", default="none", help="also a random Qwen3.5 Gated DeltaNet hybrid of this throughput.py preset")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402


def header(threads: int, device: str) -> str:
    if device.startswith("cuda"):
        return f"torch {torch.__version__} | {torch.cuda.get_device_name()} | CUDA {torch.version.cuda}"
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return (
        f"torch {torch.__version__} | CPU capability {torch.backends.cpu.get_cpu_capability()} | {cpu} | "
        f"{os.cpu_count()} cores, {threads} torch threads | load average {os.getloadavg()[0]:.2f}"
    )


def make_llm(model_dir, max_seqs: int, graphs: bool, args):
    """The engine under test (``graphs``: compiled step on CPU, CUDA graphs on CUDA) or its eager peer."""
    from layerzoo import LLM

    mode = dict(compile_decode=graphs) if args.device == "cpu" else dict(enforce_eager=not graphs)
    return LLM(str(model_dir) if model_dir else None, dtype=args.dtype, device=args.device, max_num_seqs=max_seqs,
               max_model_len=512, **mode)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def decode_round(llm, batch: int, prompt_len: int, steps: int, vocab: int, round_index: int) -> tuple[list[float], list[list[int]]]:
    """Prefill ``batch`` requests, then time ``steps`` decode steps; ``(seconds per step, tokens)``."""
    from layerzoo import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 1, min_tokens=steps + 1, ignore_eos=True)
    seqs = []
    for b in range(batch):
        prompt = [(7 * b + 13 * i + round_index) % vocab for i in range(prompt_len)]
        seqs += engine.add_request(f"r{round_index}-{b}", prompt, params)
    while any(not s.output_token_ids for s in seqs):  # the prefill (one step, or several chunks)
        engine.step()
    times = []
    device = str(llm.args.device)
    while engine.has_unfinished():
        sync(device)
        start = time.perf_counter()
        engine.step()
        sync(device)
        times.append(time.perf_counter() - start)
    for b in range(batch):
        engine.release(f"r{round_index}-{b}")
    return times, [list(s.output_token_ids) for s in seqs]


def bench_model(name: str, model_dir, args) -> list[dict]:
    max_seqs = max(args.batch)
    eager, compiled = make_llm(model_dir, max_seqs, False, args), make_llm(model_dir, max_seqs, True, args)
    torch.set_num_threads(args.threads)
    vocab = eager.loaded.config.vocab_size
    rows = []
    for batch in args.batch:
        start = time.perf_counter()
        decode_round(compiled, batch, args.prompt_len, args.steps, vocab, -1)  # compiles
        compile_s = time.perf_counter() - start
        decode_round(eager, batch, args.prompt_len, args.steps, vocab, -1)
        per_engine: dict[str, list[float]] = {"eager": [], "compiled": []}
        agree = True
        for r in range(args.rounds):
            order = [("eager", eager), ("compiled", compiled)][:: 1 if r % 2 == 0 else -1]
            tokens = {}
            for label, llm in order:
                times, tokens[label] = decode_round(llm, batch, args.prompt_len, args.steps, vocab, r)
                per_engine[label] += times
            agree &= tokens["eager"] == tokens["compiled"]
        eager_ms = statistics.median(per_engine["eager"]) * 1e3
        compiled_ms = statistics.median(per_engine["compiled"]) * 1e3
        graphs = compiled.stats.graphs
        rows.append(dict(model=name, batch=batch, eager_ms=eager_ms, compiled_ms=compiled_ms,
                         speedup=eager_ms / compiled_ms, compile_s=compile_s, same_tokens=agree,
                         replays=graphs.get("replays", 0), eager_steps=graphs.get("eager", 0),
                         compiles=compiled.engine.runner.decode_capture.compiles))
        r = rows[-1]
        print(f"  {name:<18} batch {batch:>2}: eager {eager_ms:7.2f} ms/step | compiled {compiled_ms:7.2f} ms/step | "
              f"eager/compiled {r['speedup']:.2f}x | first round (compiling) {compile_s:5.1f} s | "
              f"same tokens {agree} | replays {r['replays']}, compiles so far {r['compiles']}", flush=True)
    return rows


def random_checkpoint(preset: str, arch: str = "qwen3") -> Path | None:
    """A throughput.py checkpoint (cached in bench/.cache; building one needs transformers)."""
    sys.path.insert(0, str(HERE))
    import throughput

    shape = dict(throughput.PRESETS[preset])
    if arch != "qwen3":  # Qwen3-Next's proportions, as throughput.py --arch gives them
        shape.update(linear_k_heads=max(1, shape["heads"] // 2), linear_v_heads=shape["heads"],
                     linear_head_dim=shape["head_dim"], full_attention_interval=4)
    try:
        return throughput.build_checkpoint(shape, "float32", arch=arch)
    except ImportError as exc:
        print(f"  (skipping the random {arch} {preset}: {exc})", flush=True)
        return None


def main(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    print(header(args.threads, args.device), flush=True)
    print(f"{args.device}, {args.dtype}: prompt {args.prompt_len} tokens, {args.steps} decode steps x {args.rounds} rounds "
          f"per engine, median step time (each step: schedule, forward, sample, detokenize)", flush=True)
    models = [("embedded tiny-qwen3", None)]
    if args.big != "none":
        models.append((f"random qwen3 {args.big}", random_checkpoint(args.big)))
    if args.hybrid != "none":
        models.append((f"random qwen3.5 {args.hybrid}", random_checkpoint(args.hybrid, "qwen3_5")))
    models = [(name, path) for name, path in models if path is not None or name.startswith("embedded")]
    rows = []
    for name, model_dir in models:
        rows += bench_model(name, model_dir, args)
    print("\n| model | batch | eager ms/step | graph ms/step | eager/graph | capture (first round) s | same tokens |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['model']} | {r['batch']} | {r['eager_ms']:.2f} | {r['compiled_ms']:.2f} | {r['speedup']:.2f}x | "
              f"{r['compile_s']:.1f} | {r['same_tokens']} |")
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main(ARGS)
