"""Thread defaults on a busy machine: layerzoo's defaults vs torch's, idle and next to one busy process.

Each configuration runs in a fresh Python (OpenMP reads its wait policy once, when torch loads):

- ``torch``: torch imported before layerzoo, so OpenMP keeps its spinning barriers, and the
  pool has torch's default size (the machine's cores) - what the CLI did before;
- ``layerzoo``: layerzoo's defaults (`layerzoo.threads`: a bounded spin at barriers, threads from the
  CPU affinity mask, one thread while the cores are contended: `layerzoo.runtime.cpu_contention`;
  the threads column is the count at the end of the run);
- ``one-thread``: ``OMP_NUM_THREADS=1``, the peer users fell back to.

Each runs the same greedy generation (the embedded model) idle and then with one background
process spinning on a core, and prints tokens/s and the ratios. Bounded: a few seconds of work
per run, every child killed at the end.

    python bench/threads.py                 # all three, idle and busy
    python bench/threads.py --tokens 64 --prompts 4
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, os, sys, time
order, prompts, tokens, repeats = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
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
llm = LLM(max_model_len=512)
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

CONFIGS = {
    "torch": ("torch-first", {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None, "OMP_NUM_THREADS": None}),
    "layerzoo": ("layerzoo-first", {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None, "OMP_NUM_THREADS": None}),
    "one-thread": ("layerzoo-first", {"OMP_NUM_THREADS": "1"}),
}


def run(config: str, prompts: int, tokens: int, repeats: int, timeout: float) -> dict:
    order, overrides = CONFIGS[config]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    for key, value in overrides.items():
        env.pop(key, None) if value is None else env.__setitem__(key, value)
    out = subprocess.run([sys.executable, "-c", CHILD, order, str(prompts), str(tokens), str(repeats)], env=env,
                         capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise SystemExit(f"{config}: child failed:\n{out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def busy_process() -> subprocess.Popen:
    """One process keeping a core busy (pure Python spin, no threads)."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=5, help="generations per run; the median is reported")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per run before it is killed")
    parser.add_argument("--configs", default="torch,layerzoo,one-thread")
    args = parser.parse_args()
    configs = args.configs.split(",")
    results: dict[str, dict[str, dict]] = {}
    for config in configs:
        results[config] = {"idle": run(config, args.prompts, args.tokens, args.repeats, args.timeout)}
        busy = busy_process()
        try:
            time.sleep(0.5)
            results[config]["busy"] = run(config, args.prompts, args.tokens, args.repeats, args.timeout)
        finally:
            busy.kill()
            busy.wait()
    print(f"{os.cpu_count()} CPUs, affinity {len(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.1f}; "
          f"{args.prompts} prompts x {args.tokens} greedy tokens, embedded model, median of {args.repeats}")
    print(f"{'config':12s} {'threads':>7s} {'wait':>8s} {'idle tok/s':>11s} {'busy tok/s':>11s} {'busy/idle':>10s}")
    for config, r in results.items():
        idle, busy = r["idle"], r["busy"]
        print(f"{config:12s} {busy['threads']:7d} {str(busy['wait_policy']):>8s} {idle['tokens_per_s']:11.1f} "
              f"{busy['tokens_per_s']:11.1f} {busy['tokens_per_s'] / idle['tokens_per_s']:10.2f}")
    if "torch" in results and "layerzoo" in results:
        ratio = results["layerzoo"]["busy"]["tokens_per_s"] / results["torch"]["busy"]["tokens_per_s"]
        print(f"next to one busy process: layerzoo defaults / torch defaults = {ratio:.2f}x tokens/s")


if __name__ == "__main__":
    main()
