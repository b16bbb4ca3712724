"""Single-stream decode of a random Kimi K3 with MXFP4 routed experts: kept packed against the same
weights stored dequantized in fp32 (the old load path), in one process, in turns.

The model (default: hidden 512, latent and expert width 512, 48 routed experts, 8 per token, 6
layers of which 5 MoE, vocab 4096) is written twice under ``bench/.cache`` of the repository: with
random E2M1 codes and E8M0 scales (``mxfp4-pack-quantized``), and with those codes dequantized into
fp32 weights. Both load through ``layerzoo.LLM``; every round decodes one sequence in each (the
order reversed every round) and times ``max_tokens=N`` against the faster of two ``max_tokens=1``
runs, to take prefill out. Prints the routed experts' bytes, tok/s per form and the median ratio.
No assertions::

    python plugins/kimi_k3/bench/mxfp4_decode.py                 # 2 threads, 32 tokens, 5 rounds
    python plugins/kimi_k3/bench/mxfp4_decode.py --experts 16 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[3]
CACHE = ROOT / "bench" / ".cache"
_spec = importlib.util.spec_from_file_location("k3_reference", Path(__file__).resolve().parents[1] / "tests" / "k3_reference.py")
ref = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ref)

MXFP4 = {"quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
         "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "group_size": 32, "type": "float"}}}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--latent", type=int, default=512, help="routed_expert_hidden_size (a multiple of 32)")
    p.add_argument("--expert-width", type=int, default=512, help="moe_intermediate_size (a multiple of 32)")
    p.add_argument("--experts", type=int, default=48)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    return p.parse_args(argv)


def text_config(args) -> dict:
    kda = [i + 1 for i in range(args.layers) if (i + 1) % 3]
    return ref.text_config(
        vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=2 * args.hidden,
        num_experts=args.experts, num_experts_per_token=args.top_k, num_shared_experts=1,
        moe_intermediate_size=args.expert_width, routed_expert_hidden_size=args.latent,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=128, kv_lora_rank=128, qk_nope_head_dim=32,
        qk_rope_head_dim=16, v_head_dim=32,
        linear_attn_config=dict(num_heads=4, head_dim=64, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                use_full_rank_gate=True, kda_layers=kda,
                                full_attn_layers=[i + 1 for i in range(args.layers) if i + 1 not in kda]),
    )


def random_mxfp4(shape, gen) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random codes and scales (2^-6 .. 2^-4) of a ``[out, in]`` weight, and its fp32 dequantization."""
    from layerzoo.kernels.mxfp4_matmul.reference import dequantize

    out, cols = shape
    packed = torch.randint(0, 256, (out, cols // 2), generator=gen, dtype=torch.uint8)
    scale = torch.randint(121, 124, (out, cols // 32), generator=gen, dtype=torch.uint8)
    return packed, scale, dequantize(packed, scale)


def build(args) -> dict[str, Path]:
    text = text_config(args)
    key = "k3_mxfp4_" + "_".join(str(v) for v in (args.hidden, args.latent, args.expert_width, args.experts, args.top_k,
                                                   args.layers, args.vocab))
    dirs = {form: CACHE / key / form for form in ("mxfp4", "fp32")}
    if all((d / "model.safetensors").exists() for d in dirs.values()):
        return dirs
    from layerzoo.testing import write_word_tokenizer

    gen = torch.Generator().manual_seed(0)
    plain, packed = {}, {}
    for name, shape in ref.shapes(text).items():
        if ".experts." in name:
            codes, scale, w = random_mxfp4(shape, gen)
            plain[name] = w
            packed[name.replace(".weight", ".weight_packed")], packed[name.replace(".weight", ".weight_scale")] = codes, scale
        else:
            t = torch.randn(shape, generator=gen) * (0.02 if len(shape) == 2 else 0.1)
            if name.endswith(("norm.weight", "layernorm.weight")):
                t = t + 1.0
            plain[name] = packed[name] = t
    for form, tensors in (("mxfp4", packed), ("fp32", plain)):
        d = dirs[form]
        d.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(d / "model.safetensors"))
        cfg = dict(text, quantization_config=MXFP4) if form == "mxfp4" else text
        (d / "config.json").write_text(json.dumps(dict(architectures=["KimiK3ForConditionalGeneration"], model_type="kimi_k3",
                                                       text_config=cfg, tie_word_embeddings=False)))
        write_word_tokenizer(d, args.vocab)
    return dirs


def timed(llm, prompt, n) -> float:
    from layerzoo import SamplingParams

    t = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)
    return time.perf_counter() - t


def expert_bytes(model) -> int:
    from layerzoo_kimi_k3.kimi_k3 import SituExperts

    return sum(p.numel() * p.element_size() for m in model.modules() if isinstance(m, SituExperts) for p in m.parameters())


def main(args) -> None:
    from layerzoo import LLM

    torch.set_num_threads(args.threads)
    dirs = build(args)
    llms = {}
    for form, d in dirs.items():
        llm = LLM(str(d), dtype="float32", max_num_seqs=1, max_model_len=64 + args.tokens, enable_prefix_caching=False)
        torch.set_num_threads(args.threads)
        print(f"{form}: routed experts {expert_bytes(llm.engine.runner.model) / 2**20:.1f} MiB", flush=True)
        timed(llm, [1, 2, 3], 4)  # warm
        llms[form] = llm
    rates: dict[str, list[float]] = {f: [] for f in llms}
    for r in range(args.rounds):
        for form in (list(llms) if r % 2 == 0 else list(reversed(llms))):
            prompt = [5 + r] + list(range(9, 25))
            one = min(timed(llms[form], prompt, 1) for _ in range(2))
            full = timed(llms[form], prompt, args.tokens)
            if full > one:
                rates[form].append((args.tokens - 1) / (full - one))
    for form, values in rates.items():
        line = f"{form}: {statistics.median(values):.1f} tok/s (min {min(values):.1f}, max {max(values):.1f})" if values else f"{form}: no sample"
        if form == "mxfp4" and values and rates["fp32"]:
            ratios = [a / b for a, b in zip(values, rates["fp32"])]
            line += f"; x fp32 median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max {max(ratios):.2f})"
        print(line, flush=True)


if __name__ == "__main__":
    sys.exit(main(parse_args()))
