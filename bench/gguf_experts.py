"""GGUF routed experts kept in their blocks against the same file dequantized to fp32 (``dtype=float32``):
resident memory added by loading and one-stream decode tok/s of a random Qwen3-MoE GGUF, in turns.

The file: a random-init Qwen3-MoE (transformers) whose dense weights are Q8_0 and whose experts are
random Q4_K blocks with Q6_K down projections (as Q4_K_M keeps them), written by
`layerzoo.testing.gguf_files`. Each (turn, mode) loads the file in a fresh process and prints the RSS it
added (after the GGUF parse is dropped; the rest beyond the weights' bytes is the runtime's own
share: KV cache, kernels, allocator), the bytes of the weights and of the expert tensors, and decode tok/s: ``N``
tokens over the time of a ``N + 1``-token generation less that of a 1-token one (the prefill). It
never asserts timings. Examples::

    python bench/gguf_experts.py
    python bench/gguf_experts.py --hidden 2048 --moe-intermediate 768 --experts 16 --layers 4 --turns 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MODES = {"blocks": "auto", "dequantized": "float32"}


def rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def make_file(args, root: Path) -> Path:
    import numpy as np
    import torch
    import transformers

    from layerzoo.testing.gguf_files import byte_level_bpe, random_kquant_blocks, write_gguf

    vocab = 320
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, max_position_embeddings=512,
        rms_norm_eps=1e-5, initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        intermediate_size=256, moe_intermediate_size=args.moe_intermediate, num_attention_heads=args.hidden // 128,
        num_key_value_heads=2, head_dim=128, num_experts=args.experts, num_experts_per_tok=args.top_k,
        norm_topk_prob=True, tie_word_embeddings=False,
    )
    transformers.Qwen3MoeForCausalLM(config).eval().save_pretrained(root / "src")
    rng = np.random.default_rng(0)
    extra, names = {}, []
    for layer in range(args.layers):
        for kind in ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps"):
            down = kind == "ffn_down_exps"
            rows, k = (args.hidden, args.moe_intermediate) if down else (args.moe_intermediate, args.hidden)
            qtype = "Q6_K" if down else "Q4_K"
            name = f"blk.{layer}.{kind}.weight"
            names.append(name)
            extra[name] = (random_kquant_blocks(qtype, (args.experts, rows), k, rng), qtype)
    return write_gguf(root / "moe-Q4_K_M.gguf", root / "src", qtype="Q8_0", tokenizer=byte_level_bpe(vocab),
                      skip=tuple(names), extra=extra)


def child(path: str, mode: str, tokens: int) -> dict:
    """One load and decode in this process: what `main` runs per (turn, mode)."""
    import gc

    import torch

    from layerzoo import LLM, SamplingParams
    from layerzoo.layers.moe import StackedExperts
    from layerzoo.loading.gguf_loading import forget_opened

    torch.set_num_threads(int(os.environ.get("THREADS", torch.get_num_threads())))
    before = rss_bytes()
    llm = LLM(path, dtype=MODES[mode], max_model_len=tokens + 64, max_num_seqs=1)
    forget_opened()
    gc.collect()
    added = rss_bytes() - before
    experts = sum(p.numel() * p.element_size() for m in llm.engine.runner.model.modules()
                  if isinstance(m, StackedExperts) for p in (m.gate_up_proj, m.down_proj))
    model = llm.engine.runner.model
    weights = sum(t.numel() * t.element_size() for t in {id(t): t for t in (*model.parameters(), *model.buffers())}.values())
    prompt = [{"prompt_token_ids": [5, 17, 42, 99]}]

    def timed(n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompt, SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True))
        return time.perf_counter() - start

    timed(8)  # warm-up
    first, whole = min(timed(1) for _ in range(3)), timed(tokens + 1)
    return {"rss_added": added, "weight_bytes": weights, "expert_bytes": experts, "tok_s": tokens / (whole - first)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--moe-intermediate", type=int, default=768)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("FILE", "MODE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.tokens)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        path = make_file(args, Path(tmp))
        print(f"{path.name}: {path.stat().st_size / 2**20:.1f} MiB; hidden {args.hidden}, moe_intermediate "
              f"{args.moe_intermediate}, {args.experts} experts (top {args.top_k}), {args.layers} layers, "
              f"{os.environ.get('THREADS', 'default')} threads")
        results: dict[str, list[dict]] = {mode: [] for mode in MODES}
        for turn in range(args.turns):
            for mode in MODES:
                out = subprocess.run([sys.executable, __file__, "--child", str(path), mode, "--tokens", str(args.tokens)],
                                     check=True, capture_output=True, text=True).stdout
                result = json.loads(out.strip().splitlines()[-1])
                results[mode].append(result)
                print(f"turn {turn} {mode:11s}: RSS added {result['rss_added'] / 2**20:7.1f} MiB (weights "
                      f"{result['weight_bytes'] / 2**20:6.1f} MiB), experts "
                      f"{result['expert_bytes'] / 2**20:6.1f} MiB, decode {result['tok_s']:6.1f} tok/s")
    medians = {mode: {key: statistics.median(r[key] for r in rs) for key in rs[0]} for mode, rs in results.items()}
    b, d = medians["blocks"], medians["dequantized"]
    print(f"median: blocks {b['rss_added'] / 2**20:.1f} MiB, {b['tok_s']:.1f} tok/s; dequantized "
          f"{d['rss_added'] / 2**20:.1f} MiB, {d['tok_s']:.1f} tok/s; memory {d['rss_added'] / b['rss_added']:.2f}x less, "
          f"experts {d['expert_bytes'] / b['expert_bytes']:.2f}x less, decode {b['tok_s'] / d['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
