"""The model side of tensor parallelism: one rank vs N ranks (CPU processes over gloo), same model,
same tokens, no engine. Prints the prefill and per-step decode times of each, their ratio, and the
weight bytes each rank holds (the point of splitting: 1/N of the matrices per rank).

    PY=.venv/bin/python
    $PY bench/tp_layers.py                       # tiny random Qwen3, 2 ranks, 1 thread per rank
    $PY bench/tp_layers.py --size small --ranks 2 --threads 1

On a 2-core CPU a 2-rank run is not expected to be faster: each layer adds two all-reduces over
gloo, which cost more than the halved matmuls of a small model. The figures are for the record
(and for comparing changes to the parallel layers); the engine-level benchmark with NCCL belongs to
a GPU machine. Never asserts a timing.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

SIZES = {  # hidden, layers, heads, kv heads, head_dim, intermediate, vocab
    "tiny": (256, 4, 4, 2, 64, 1024, 8192),
    "small": (768, 12, 12, 4, 64, 2048, 32000),
}


def build(size: str) -> Path:
    """A random Qwen3 of ``size`` under bench/.cache (built once)."""
    path = Path(__file__).with_name(".cache") / f"tp-qwen3-{size}"
    if (path / "config.json").exists():
        return path
    import transformers

    from layerzoo.testing import write_word_tokenizer

    hidden, layers, heads, kv, head_dim, inter, vocab = SIZES[size]
    config = transformers.Qwen3Config(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=head_dim, initializer_range=0.25,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    write_word_tokenizer(path, vocab)
    return path


def time_on_rank(model_dir: str, prompt_len: int, decodes: int, repeats: int, threads: int) -> dict:
    """This rank's best-of-``repeats`` prefill time and decode time per step (seconds), and the
    bytes of its parameters."""
    from layerzoo.loading.model_loading import load_model
    from layerzoo.testing.distributed import step_logits

    torch.set_num_threads(threads)
    model = load_model(Path(model_dir)).model
    ids = torch.randint(0, model.config.vocab_size, (prompt_len + decodes,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt, rest = ids[:prompt_len], ids[prompt_len:]
    best_prefill = best_total = float("inf")
    for _ in range(repeats + 1):  # the first run warms up
        start = time.perf_counter()
        step_logits(model, prompt, [prompt_len])
        middle = time.perf_counter()
        step_logits(model, prompt, [prompt_len], rest)
        end = time.perf_counter()
        best_prefill, best_total = min(best_prefill, middle - start), min(best_total, end - middle)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    return {"prefill": best_prefill, "decode": (best_total - best_prefill) / decodes, "bytes": weight_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=SIZES, default="tiny")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--decodes", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    from layerzoo.testing.distributed import run_on_ranks

    path = str(build(args.size))
    target = "tp_layers:time_on_rank"  # this file's directory is on the spawned ranks' path
    work = (path, args.prompt, args.decodes, args.repeats, args.threads)
    one = run_on_ranks(target, *work, world_size=1)[0]
    many = run_on_ranks(target, *work, world_size=args.ranks)
    slowest = {key: max(r[key] for r in many) for key in ("prefill", "decode")}
    print(f"Qwen3 {args.size}, prompt {args.prompt}, {args.decodes} decode steps, {args.threads} thread(s) per rank")
    print(f"{'':>10} {'prefill ms':>12} {'decode ms/step':>15} {'weights MiB/rank':>17}")
    print(f"{'TP=1':>10} {one['prefill'] * 1e3:12.1f} {one['decode'] * 1e3:15.2f} {one['bytes'] / 2**20:17.1f}")
    print(f"{f'TP={args.ranks}':>10} {slowest['prefill'] * 1e3:12.1f} {slowest['decode'] * 1e3:15.2f} {many[0]['bytes'] / 2**20:17.1f}")
    print(f"ratio TP={args.ranks} / TP=1: prefill {slowest['prefill'] / one['prefill']:.2f}x, "
          f"decode {slowest['decode'] / one['decode']:.2f}x, weights per rank {many[0]['bytes'] / one['bytes']:.2f}x")


if __name__ == "__main__":
    main()
