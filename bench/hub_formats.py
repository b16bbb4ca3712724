"""Single-stream decode speed of hub quantization formats against fp32, in one process, in turns.

A random Qwen3-shaped model (default ~0.27B: hidden 1024, 16 layers, intermediate 3072, vocab
16384, untied LM head kept fp32 as the formats' ``ignore: [lm_head]`` does) is saved three ways
under ``bench/.cache``: fp32, compressed-tensors W4A16 (``pack-quantized``, symmetric, group 128)
and ``quant_method: "fp8"`` with ``[128, 128]`` block scales (as Qwen3-*-FP8). Each loads through
``layerzoo.LLM``; every round decodes one sequence in each format (the order reversed every round)
and times ``max_tokens=N`` against the faster of two ``max_tokens=1`` runs to take prefill out. Prints tok/s per format,
the median ratios to fp32 with their range, and the weights' bytes. No assertions::

    python bench/hub_formats.py                     # 0.27B, 64 tokens, 5 rounds, 2 threads
    python bench/hub_formats.py --layers 8 --tokens 32 --rounds 3
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_flags import cpu_summary  # noqa: E402

CACHE = Path(__file__).resolve().parent / ".cache"
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--intermediate", type=int, default=3072)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded per round and format (default 64)")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--formats", nargs="+", default=["fp32", "w4a16", "fp8"], choices=["fp32", "w4a16", "fp8"])
    return p.parse_args(argv)


def words(values: torch.Tensor) -> torch.Tensor:
    """Nibbles ``[..., 8 W]`` (0..15) → int32 ``[..., W]``, nibble j in bits 4j (compressed-tensors' packing)."""
    v = values.long().reshape(*values.shape[:-1], -1, 8)
    packed = (v << (4 * torch.arange(8))).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def w4a16(w: torch.Tensor, group: int = 128) -> dict[str, torch.Tensor]:
    n, k = w.shape
    g = w.reshape(n, k // group, group)
    scale = (g.abs().amax(-1) / 7.5).clamp_min(1e-8).half()
    q = torch.round(g / scale.float()[..., None] + 8).clamp(0, 15).reshape(n, k)
    return {"weight_packed": words(q), "weight_scale": scale, "weight_shape": torch.tensor([n, k])}


def fp8_block(w: torch.Tensor, block: int = 128) -> dict[str, torch.Tensor]:
    n, k = w.shape
    b = w.reshape(n // block, block, k // block, block)
    scale = (b.abs().amax(dim=(1, 3)) / 448).clamp_min(1e-12)
    q = (b / scale[:, None, :, None]).clamp(-448, 448).reshape(n, k).to(torch.float8_e4m3fn)
    return {"weight": q, "weight_scale_inv": scale.float()}


def build(args) -> dict[str, Path]:
    """The three checkpoints (cached by shape)."""
    import transformers
    from safetensors.torch import load_file, save_file

    from layerzoo.testing import write_word_tokenizer

    shape = dict(hidden=args.hidden, layers=args.layers, intermediate=args.intermediate, vocab=args.vocab)
    key = hashlib.sha1(json.dumps(shape, sort_keys=True).encode()).hexdigest()[:8]
    root = CACHE / f"hub-formats-h{args.hidden}-l{args.layers}-{key}"
    dirs = {f: root / f for f in ("fp32", "w4a16", "fp8")}
    if all((d / "tokenizer.json").exists() for d in dirs.values()):
        return dirs
    print(f"building {root} ...", flush=True)
    heads = args.hidden // 64
    config = transformers.Qwen3Config(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate, num_hidden_layers=args.layers,
        num_attention_heads=heads, num_key_value_heads=max(1, heads // 2), head_dim=64, max_position_embeddings=4096,
        tie_word_embeddings=False, initializer_range=0.05, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(dirs["fp32"])
    write_word_tokenizer(dirs["fp32"], args.vocab)
    state = load_file(dirs["fp32"] / "model.safetensors")
    base = json.loads((dirs["fp32"] / "config.json").read_text())
    qcs = {
        "w4a16": {"quant_method": "compressed-tensors", "format": "pack-quantized", "ignore": ["lm_head"],
                  "config_groups": {"group_0": {"targets": ["Linear"], "input_activations": None, "weights": {
                      "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128}}}},
        "fp8": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]},
    }
    for fmt, quantize in (("w4a16", w4a16), ("fp8", fp8_block)):
        out = {}
        for name, tensor in state.items():
            prefix, _, leaf = name.rpartition(".")
            if leaf == "weight" and prefix.rpartition(".")[2] in LINEARS:
                out.update({f"{prefix}.{k}": v for k, v in quantize(tensor.float()).items()})
            else:
                out[name] = tensor
        dirs[fmt].mkdir(parents=True, exist_ok=True)
        save_file(out, dirs[fmt] / "model.safetensors")
        (dirs[fmt] / "config.json").write_text(json.dumps({**base, "quantization_config": qcs[fmt]}))
        write_word_tokenizer(dirs[fmt], args.vocab)
    return dirs


def timed(llm, prompt, n) -> float:
    from layerzoo import SamplingParams

    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t


def main(args) -> None:
    from layerzoo import LLM
    from layerzoo.layers.linear_method import LinearMethod

    torch.set_num_threads(args.threads)
    print(cpu_summary())
    dirs = build(args)
    llms = {}
    for fmt in args.formats:
        llm = LLM(str(dirs[fmt]), max_num_seqs=1, max_model_len=64 + args.tokens, enable_prefix_caching=False)
        torch.set_num_threads(args.threads)
        model = llm.engine.runner.model
        linear_bytes = 0
        for m in model.layers.modules():
            if isinstance(m, LinearMethod):
                linear_bytes += m.weight_bytes()
            elif isinstance(m, torch.nn.Linear):
                linear_bytes += getattr(m, "packed_bytes", None) or m.weight.numel() * m.weight.element_size()
        print(f"{fmt}: decoder linear weights {linear_bytes / 2**20:.0f} MiB", flush=True)
        timed(llm, [1, 2, 3], 4)  # warm
        llms[fmt] = llm
    rates: dict[str, list[float]] = {f: [] for f in llms}
    for r in range(args.rounds):
        order = list(llms) if r % 2 == 0 else list(reversed(llms))
        for fmt in order:
            prompt = [5 + r] + list(range(9, 25))
            one = min(timed(llms[fmt], prompt, 1) for _ in range(2))  # prefill + first token
            full = timed(llms[fmt], prompt, args.tokens)
            if full > one:  # else a neighbour's burst swamped the turn: no sample
                rates[fmt].append((args.tokens - 1) / (full - one))
    for fmt, values in rates.items():
        if not values:
            print(f"{fmt}: no sample")
            continue
        line = f"{fmt}: {statistics.median(values):.1f} tok/s (min {min(values):.1f}, max {max(values):.1f})"
        if fmt != "fp32" and "fp32" in rates:
            ratios = [a / b for a, b in zip(values, rates["fp32"])] or [float("nan")]
            line += f"; x fp32 median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})"
        print(line, flush=True)


if __name__ == "__main__":
    main(parse_args())
