"""Tensor parallelism: the same batch on TP=1 and TP=N, tokens/s and their ratio, in one run.

Builds a random Qwen3 (transformers, safetensors, cached under bench/.cache/), runs one greedy
batch on a single process and then on N ranks (`LLM(tensor_parallel_size=N)`: gloo on CPU, NCCL
on CUDA), prints the throughput of each and TP=N / TP=1, and checks that the greedy tokens agree
(tie-aware: `layerzoo.testing.parity`). Never asserts a timing.

On a CPU the ranks split the cores (2 ranks on 2 cores: 1 thread each) and add a broadcast per
step, so TP=2 is not expected to be faster there; the figure is for the record. On a machine with
N GPUs, ``--device cuda`` runs rank r on cuda:r. Examples::

    python bench/tensor_parallel.py                      # tiny model, TP=2 vs TP=1 on CPU
    python bench/tensor_parallel.py --size small --tp 2 --batch 8 --max-tokens 64
    python bench/tensor_parallel.py --device cuda --size small --dtype bfloat16 --tp 2
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"

PRESETS = {
    # name: hidden, layers, heads, kv_heads, head_dim, intermediate, vocab
    "tiny": dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=1024, vocab=8192),
    "small": dict(hidden=768, layers=12, heads=12, kv_heads=4, head_dim=64, intermediate=2048, vocab=32000),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--tp", type=int, default=2, help="ranks of the tensor-parallel run (default 2)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (rank r on cuda:r)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--batch", type=int, default=4, help="prompts in the batch")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2, help="timed runs per engine (the best counts)")
    return p.parse_args(argv)


def build_model(size: str) -> Path:
    """A random Qwen3 of the preset's shape, saved once (initializer_range 0.25: few near-ties)."""
    path = CACHE / f"tp-qwen3-{size}"
    if (path / "config.json").exists():
        return path
    import torch
    import transformers

    from layerzoo.testing import write_word_tokenizer

    s = PRESETS[size]
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv_heads"], head_dim=s["head_dim"],
        initializer_range=0.25, max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None,
    )
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    write_word_tokenizer(path, config.vocab_size)
    return path


def timed(llm, prompts, params, repeats: int) -> tuple[float, list[list[int]]]:
    """Best wall time of ``repeats`` generate calls (after one warm-up call) and the tokens."""
    llm.generate(prompts[:1], params, use_tqdm=False)
    best, tokens = float("inf"), None
    for _ in range(repeats):
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
        tokens = [o.outputs[0].token_ids for o in outs]
    return best, tokens


def main(argv=None) -> int:
    args = parse_args(argv)
    from layerzoo import LLM, SamplingParams
    from layerzoo.testing.parity import greedy_divergences

    path = build_model(args.size)
    vocab = PRESETS[args.size]["vocab"]
    rng = random.Random(0)
    token_prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    prompts = [{"prompt_token_ids": p} for p in token_prompts]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    # Prefix caching off: the repeats must compute their prompts again.
    engine = dict(dtype=args.dtype, device=args.device, max_model_len=args.prompt_len + args.max_tokens + 16,
                  max_num_seqs=max(args.batch, 1), enable_prefix_caching=False)
    new_tokens = args.batch * args.max_tokens
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    print(f"model: random Qwen3 '{args.size}', {args.dtype} on {args.device}; batch {args.batch} x "
          f"({args.prompt_len} prompt + {args.max_tokens} new tokens); {cpus} CPUs")

    single = LLM(path, **engine)
    t1, ref = timed(single, prompts, params, args.repeats)
    print(f"TP=1       {t1:8.3f} s  {new_tokens / t1:9.1f} new tok/s")
    with LLM(path, tensor_parallel_size=args.tp, **engine) as tp:
        tn, got = timed(tp, prompts, params, args.repeats)
    print(f"TP={args.tp:<7d} {tn:8.3f} s  {new_tokens / tn:9.1f} new tok/s")
    print(f"ratio TP={args.tp} / TP=1 throughput: {t1 / tn:.2f}x")
    ties, real = greedy_divergences(single.engine.model, token_prompts, ref, got)
    print(f"greedy agreement: {args.batch - len(ties) - len(real)}/{args.batch} identical, "
          f"{len(ties)} diverge at a near-tie, {len(real)} diverge elsewhere")
    return 1 if real else 0


if __name__ == "__main__":
    sys.exit(main())
