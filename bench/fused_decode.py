"""The fused CPU decode layer against the layers' Python path, in one engine, in turns.

Each plain pre-norm layer of a random Qwen3 preset (``throughput.py``'s, cached under
``bench/.cache``) decodes either as one C++ call (`layerzoo.layers.fused_decode`, the default) or
through its Python path; the script flips every layer's plan between generations in an order that
reverses each round and prints the decode time per token of each, the median of the per-round
ratios (Python / fused) with their range, and whether the greedy tokens were the same. It never
asserts a timing::

    python bench/fused_decode.py                              # 0.6B, fp32 and bf16, one sequence
    python bench/fused_decode.py --dtype bfloat16 --batch 1 4 --rounds 12
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_flags import cpu_summary  # noqa: E402
from throughput import PRESETS, build_checkpoint  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(PRESETS), default="0.6b")
    p.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    p.add_argument("--quantization", nargs="+", default=["none"], choices=["none"],
                   help="weights as loaded (none; int8 runs as Q8_0 blocks, which the fused call does not take)")
    p.add_argument("--batch", type=int, nargs="+", default=[1], help="sequences decoding together (default 1)")
    p.add_argument("--tokens", type=int, default=32, help="tokens generated per sequence and round (default 32)")
    p.add_argument("--rounds", type=int, default=8, help="rounds; each runs both paths (default 8)")
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def layer_plans(llm) -> tuple[list, list]:
    layers = list(llm.engine.runner.model.layers)
    return layers, [layer.__dict__.get("_decode_plan") for layer in layers]


def measure(llm, layers, plans, fused: bool, prompts, n: int) -> tuple[float, list]:
    from layerzoo import SamplingParams

    for layer, plan in zip(layers, plans):
        layer.__dict__["_decode_plan"] = plan if fused else None
    params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    ms = statistics.median((o.metrics["total_s"] - o.metrics["time_to_first_token_s"]) / (n - 1) * 1e3 for o in out)
    return ms, [list(o.outputs[0].token_ids) for o in out]


def main(args) -> None:
    from layerzoo import LLM, SamplingParams

    torch.set_num_threads(args.threads)
    print(cpu_summary())
    checkpoint = build_checkpoint(dict(PRESETS[args.size]), "float32")
    runs = [(d, q, b) for d in args.dtype for q in args.quantization for b in args.batch]
    for dtype, quantization, batch in runs:
        # no prefix caching: a prompt seen in the other path's turn would prefill differently
        llm = LLM(str(checkpoint), dtype=dtype, max_num_seqs=batch, max_model_len=64 + args.tokens,
                  enable_prefix_caching=False, quantization=None if quantization == "none" else quantization)
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=3))  # plans made
        layers, plans = layer_plans(llm)
        fused_layers = sum(p is not None for p in plans)
        times = {True: [], False: []}
        same = True
        for r in range(args.rounds):
            prompts = [[5 + r + i] + list(range(9, 25)) for i in range(batch)]
            got = {}
            for fused in ((True, False) if r % 2 else (False, True)):
                ms, got[fused] = measure(llm, layers, plans, fused, prompts, args.tokens)
                times[fused].append(ms)
            same &= got[True] == got[False]
        ratios = [p / f for f, p in zip(times[True], times[False])]
        mode = dtype if quantization == "none" else f"{dtype} {quantization}"
        print(f"{args.size} {mode} batch {batch} ({fused_layers}/{len(layers)} layers fused): decode ms/token "
              f"fused {statistics.median(times[True]):.1f}, Python {statistics.median(times[False]):.1f}; Python / fused "
              f"median {statistics.median(ratios):.3f}x (min {min(ratios):.3f}, max {max(ratios):.3f}, n={len(ratios)}); "
              f"same tokens {same}", flush=True)
        del llm


if __name__ == "__main__":
    main(parse_args())
