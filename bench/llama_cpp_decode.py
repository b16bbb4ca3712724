"""Single-stream decode (and prefill) of layerzoo vs llama.cpp, each in the same weight format, on
one random Qwen3 checkpoint converted to GGUF by llama.cpp's own converter.

The checkpoint is bench/throughput.py's random preset (``--size``, default ``0.6b``). It is
converted with ``convert_hf_to_gguf.py`` from the llama-cpp-python sdist (``--converter``: the
sdist's ``vendor/llama.cpp``, printed by ``shared/tools/peer-llama-setup`` with
``PEER_LLAMA_CONVERTER=1``) to f32, f16 and q8_0. The preset's word-level tokenizer has no BPE
merges, which llama.cpp's ``gpt2`` vocabulary needs; the GGUF gets a small byte-level BPE instead
(prompts are token ids, so the vocabulary only has to load) and the converter's pre-tokenizer
hash check is told ``qwen2``. The tensors are the checkpoint's own.

Pairs, run back to back in each of ``--rounds`` rounds (the order alternates):

==========================  ==============================
layerzoo                    llama.cpp
==========================  ==============================
``dtype="float32"``         f32
``quantization="int8"``     q8_0
``dtype="bfloat16"``        f16 (the nearest 16-bit format llama.cpp runs on CPU)
==========================  ==============================

Per engine: decode tok/s (tokens after the first / time after the first), and prefill tok/s of a
``--prefill`` token prompt (prompt tokens / time to the first token). llama.cpp runs in its own
venv (``--llama-cpp-python``) with ``--threads`` threads, from a temporary directory. Prints the
ratios layerzoo / llama.cpp per round and their spread; never asserts timings. Example::

    PEER=$(PEER_LLAMA_CONVERTER=1 shared/tools/peer-llama-setup)   # two lines: venv, converter dir
    python bench/llama_cpp_decode.py --llama-cpp-python VENV/bin/python --converter VENDOR_DIR
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="0.6b", help="bench/throughput.py preset (default 0.6b)")
    p.add_argument("--llama-cpp-python", required=True, help="python of a venv with llama-cpp-python")
    p.add_argument("--converter", required=True, help="llama.cpp source dir with convert_hf_to_gguf.py and gguf-py/")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--pairs", default="fp32,int8,bf16", help="which pairs: fp32 (f32), int8 (q8_0), bf16 (f16)")
    p.add_argument("--rounds", type=int, default=2, help="back-to-back rounds (the spread is printed)")
    p.add_argument("--prompt", type=int, default=16, help="decode: prompt tokens")
    p.add_argument("--tokens", type=int, default=64, help="decode: generated tokens")
    p.add_argument("--prefill", type=int, default=128, help="prefill: prompt tokens (one output token)")
    p.add_argument("--repeat", type=int, default=2, help="timed runs per engine and round (best is kept)")
    p.add_argument("--compile-decode", action="store_true",
                   help="layerzoo runs decode steps torch.compile'd (EngineArgs.compile_decode; compiles once per run)")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    os.environ["OMP_NUM_THREADS"] = str(ARGS.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from cpu_flags import cpu_summary  # noqa: E402
from throughput import CACHE, HERE, PRESETS, build_checkpoint, llama_cpp_job  # noqa: E402

import layerzoo  # noqa: E402,F401

PAIRS = {  # name: (layerzoo LLM kwargs, llama.cpp outtype)
    "fp32": (dict(dtype="float32"), "f32"),
    "int8": (dict(dtype="float32", quantization="int8"), "q8_0"),
    "bf16": (dict(dtype="bfloat16"), "f16"),
}

# Run inside the converter's interpreter: the pre-tokenizer hash of a BPE trained here is not in
# the converter's table; any known name loads (prompts are token ids). Qwen2's set_vocab would try
# sentencepiece first (an ImportError here): the checkpoint's tokenizer is a tokenizer.json BPE.
CONVERT = """
import sys
sys.path[:0] = [{gguf_py!r}, {src!r}]
import convert_hf_to_gguf as convert
from conversion.base import TextModel
TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
from conversion.qwen import Qwen2Model  # it tries sentencepiece first, which is not installed
Qwen2Model.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv = ["convert_hf_to_gguf.py", {model!r}, "--outtype", {outtype!r}, "--outfile", {out!r}]
convert.main()
"""


def convert_dir(checkpoint: Path) -> Path:
    """The checkpoint's tensors and config beside a small byte-level BPE (what the converter reads)."""
    from layerzoo.testing.gguf_files import byte_level_bpe

    out = CACHE / f"{checkpoint.name}-for-gguf"
    if (out / "tokenizer.json").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    for f in checkpoint.iterdir():
        if f.suffix in (".safetensors", ".json") and not f.name.startswith("tokenizer"):
            (out / f.name).unlink(missing_ok=True)
            (out / f.name).symlink_to(f.resolve())
    byte_level_bpe(300).save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return out


def gguf_file(checkpoint: Path, converter: Path, outtype: str) -> Path:
    out = CACHE / f"{checkpoint.name}-{outtype}.gguf"
    if out.exists():
        return out
    src = convert_dir(checkpoint)
    script = CONVERT.format(gguf_py=str(converter / "gguf-py"), src=str(converter), model=str(src), outtype=outtype,
                            out=str(out) + ".tmp")
    print(f"converting to {out.name} ...", flush=True)
    with tempfile.TemporaryDirectory() as tmp:  # not from the repository root (kernels/ shadows packages)
        proc = subprocess.run([sys.executable, "-c", script], cwd=tmp, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"convert_hf_to_gguf.py failed:\n{proc.stderr[-3000:]}")
    Path(str(out) + ".tmp").rename(out)
    return out


def run_layerzoo(checkpoint: Path, kwargs: dict, prompts: list[list[int]], outs: list[int], threads: int) -> dict:
    from layerzoo import LLM, SamplingParams

    llm = LLM(str(checkpoint), max_num_seqs=1, max_model_len=max(map(len, prompts)) + max(outs) + 16, **kwargs)
    torch.set_num_threads(threads)

    def params(n):
        return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)

    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params(2))  # warm-up
    firsts, totals, tokens = [], [], []
    for prompt, n in zip(prompts, outs):
        (r,) = llm.generate([{"prompt_token_ids": prompt}], params(n))
        firsts.append(r.metrics["time_to_first_token_s"])
        totals.append(r.metrics["total_s"])
        tokens.append(list(r.outputs[0].token_ids))
    del llm
    return dict(first_s=firsts, total_s=totals, tokens=tokens)


def rates(result: dict, prompts, outs, repeat: int) -> tuple[float, float]:
    """(best decode tok/s over the first ``repeat`` runs, best prefill tok/s over the rest)."""
    decode = max((n - 1) / (t - f) for f, t, n in zip(result["first_s"][:repeat], result["total_s"][:repeat], outs))
    prefill = max(len(p) / f for p, f in zip(prompts[repeat:], result["first_s"][repeat:]))
    return decode, prefill


def main(args) -> None:
    torch.set_num_threads(args.threads)
    checkpoint = build_checkpoint(dict(PRESETS[args.size]), "float32")
    converter = Path(args.converter)
    pairs = [p.strip() for p in args.pairs.split(",") if p.strip()]
    ggufs = {name: gguf_file(checkpoint, converter, PAIRS[name][1]) for name in pairs}
    print(cpu_summary())
    print(f"== single stream | qwen3 {args.size} {PRESETS[args.size]} | threads {args.threads} | torch {torch.__version__} "
          f"| load avg {os.getloadavg()[0]:.2f} ==")
    vocab = PRESETS[args.size]["vocab"]
    rng = random.Random(0)
    decode_prompt = [rng.randrange(1, vocab) for _ in range(args.prompt)]
    # A new prefill prompt each repeat: a repeated one is a prefix-cache hit in layerzoo (and a
    # reused prefix in llama-cpp-python's generate), which measured no prefill at all.
    prefill_prompts = [[rng.randrange(1, vocab) for _ in range(args.prefill)] for _ in range(args.repeat)]
    prompts = [decode_prompt] * args.repeat + prefill_prompts
    outs = [args.tokens] * args.repeat + [1] * args.repeat
    print(f"decode: prompt {args.prompt}, {args.tokens} generated, decode = after the first token; prefill: "
          f"{args.prefill}-token prompts (a new one each time), one token; best of {args.repeat} per engine, {args.rounds} rounds back to back")
    rows, ratios = [], {name: ([], []) for name in pairs}
    for rnd in range(args.rounds):
        for name in pairs:
            kwargs, outtype = PAIRS[name]
            kwargs = dict(kwargs, compile_decode=True) if args.compile_decode else kwargs
            order = ("layerzoo", "llama.cpp") if rnd % 2 == 0 else ("llama.cpp", "layerzoo")
            got, tokens = {}, {}
            for engine in order:
                if engine == "layerzoo":
                    res = run_layerzoo(checkpoint, kwargs, prompts, outs, args.threads)
                else:
                    res = llama_cpp_job(args.llama_cpp_python, ggufs[name], prompts, outs, args.threads, "sequential")
                got[engine] = rates(res, prompts, outs, args.repeat)
                tokens[engine] = res["tokens"][0]
            (lz_d, lz_p), (cpp_d, cpp_p) = got["layerzoo"], got["llama.cpp"]
            ratios[name][0].append(lz_d / cpp_d)
            ratios[name][1].append(lz_p / cpp_p)
            rows.append([rnd + 1, f"{name} / {outtype}", f"{lz_d:.1f}", f"{cpp_d:.1f}", f"{lz_d / cpp_d:.2f}",
                         f"{lz_p:.0f}", f"{cpp_p:.0f}", f"{lz_p / cpp_p:.2f}", f"{first_agreement(tokens)}/{args.tokens}"])
            print(f"  round {rnd + 1} {name}: decode {lz_d:.1f} vs {cpp_d:.1f} tok/s, prefill {lz_p:.0f} vs {cpp_p:.0f} tok/s",
                  flush=True)
    from throughput import table

    print()
    print(table(rows, ["round", "layerzoo / llama.cpp", "lz decode", "cpp decode", "decode ratio", "lz prefill",
                       "cpp prefill", "prefill ratio", "greedy agree"]))
    for name in pairs:
        d, p = ratios[name]
        print(f"{name} vs {PAIRS[name][1]}: decode layerzoo/llama.cpp {spread(d)}; prefill {spread(p)}")
    print("greedy agree: tokens before the first difference (llama.cpp's f16/q8_0 kernels round differently)")
    print(f"(load avg at the end {os.getloadavg()[0]:.2f})")


def first_agreement(tokens: dict) -> int:
    a, b = tokens["layerzoo"], tokens["llama.cpp"]
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def spread(values: list[float]) -> str:
    return f"median {statistics.median(values):.2f}x (min {min(values):.2f}, max {max(values):.2f}, n={len(values)})"


if __name__ == "__main__":
    main(ARGS)
