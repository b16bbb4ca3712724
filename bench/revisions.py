"""layerzoo at two revisions on the same workloads, in turns: did a change make the engine slower?

The base revision is checked out beside this one (``git worktree``, under bench/.cache/revisions)
and imported through a folder of links that maps its ``core/`` to ``layerzoo`` and its plugins to
their packages, ahead of the installed (editable) ones; the head is this checkout as installed.
Each run is a fresh process that loads the engine, warms up and times one workload:

* ``batch``: 8 requests of 104..155 prompt tokens and 26..39 output tokens at once (the random
  ~0.1B Qwen3 of bench/throughput.py, ``--size small``);
* ``decode``: one request, 16 prompt tokens, 128 out (the same model);
* ``hybrid``: the ``batch`` workload on the tiny random Qwen3-Next (Gated DeltaNet : attention 3 : 1).

Per run: output tokens per wall second and per CPU second of the process (user + system, every
thread). CPU seconds hardly move when other processes share the cores (the wall figures do), so
the CPU ratio is the one to read on a busy machine; with ``--threads 1`` both measure the same work.
Greedy tokens of the two revisions are compared too. Never asserts timings. Example::

    python bench/revisions.py --base d175953 --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
WORKLOADS = {
    "batch": dict(arch="qwen3", size="small", requests=8),
    "decode": dict(arch="qwen3", size="small", requests=1, prompt=16, tokens=128),
    "hybrid": dict(arch="qwen3_next", size="tiny", requests=8),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base", help="the revision to compare against (a commit, tag or branch)")
    p.add_argument("--workloads", default="batch,decode,hybrid", help=f"comma-separated, of {', '.join(WORKLOADS)}")
    p.add_argument("--rounds", type=int, default=3, help="runs per revision and workload, in turns")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each run")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker is None and args.base is None:
        p.error("--base REV is required")
    unknown = set(args.workloads.split(",")) - set(WORKLOADS)
    if unknown:
        p.error(f"--workloads: unknown {', '.join(sorted(unknown))} (known: {', '.join(WORKLOADS)})")
    return args


# -- the base revision, importable ---------------------------------------------------------------


def checkout(rev: str) -> tuple[str, Path]:
    """``(commit, worktree)`` of ``rev`` under bench/.cache/revisions, made once."""
    commit = subprocess.run(["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True, text=True)
    if commit.returncode != 0:
        sys.exit(f"--base {rev}: not a revision of {ROOT} ({commit.stderr.strip()})")
    commit = commit.stdout.strip()
    tree = HERE / ".cache" / "revisions" / commit[:12]
    if not (tree / "core" / "__init__.py").exists():
        subprocess.run(["git", "worktree", "add", "--detach", "--force", str(tree), commit], cwd=ROOT, check=True,
                       capture_output=True)
    return commit, tree


def import_links(tree: Path) -> Path:
    """A folder whose entries make ``tree``'s packages importable under their installed names."""
    links = tree.parent / f"{tree.name}-imports"
    package = links / "layerzoo"
    package.mkdir(parents=True, exist_ok=True)
    targets = {package / entry.name: entry for entry in (tree / "core").iterdir() if entry.name != "__pycache__"}
    targets[package / "kernels"] = tree / "kernels"  # installed as layerzoo.kernels
    for plugin in [*tree.glob("plugins/*/layerzoo_*"), *tree.glob("examples/*/layerzoo_*")]:
        targets[links / plugin.name] = plugin
    for link, target in targets.items():
        if not link.is_symlink():
            link.symlink_to(target)
    return links


# -- one run, in a process of its own ------------------------------------------------------------


def workload(name: str, vocab: int) -> tuple[list[list[int]], list[int]]:
    import random

    spec, rng = WORKLOADS[name], random.Random(0)
    if "prompt" in spec:
        return [[rng.randrange(1, vocab) for _ in range(spec["prompt"])]], [spec["tokens"]]
    prompts = [[rng.randrange(1, vocab) for _ in range(rng.randint(104, 155))] for _ in range(spec["requests"])]
    return prompts, [rng.randint(26, 39) for _ in prompts]


def worker(job: dict) -> dict:
    import torch

    import layerzoo
    from layerzoo import LLM, SamplingParams

    torch.set_num_threads(job["threads"])
    prompts, outs = workload(job["workload"], job["vocab"])
    llm = LLM(job["model"], dtype="float32", max_model_len=256, max_num_seqs=8)
    torch.set_num_threads(job["threads"])

    def params(n):
        return SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True)

    llm.generate([{"prompt_token_ids": [t % job["vocab"] + 1 for t in p[::-1]]} for p in prompts], [params(4) for _ in outs])
    usage, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], [params(n) for n in outs])
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime - usage.ru_utime) + (after.ru_stime - usage.ru_stime)
    tokens = [list(r.outputs[0].token_ids) for r in res]
    return dict(wall_s=wall, cpu_s=cpu, generated=sum(map(len, tokens)), tokens=tokens, source=layerzoo.__file__)


def importing(links: Path, env: dict[str, str]) -> dict[str, str]:
    """``env`` for a process that imports the base revision through ``links`` (`import_links`)."""
    return {**env, "PYTHONPATH": os.pathsep.join([str(links), *filter(None, [env.get("PYTHONPATH")])])}


def run(name: str, model: Path, vocab: int, threads: int, links: Path | None) -> dict:
    """One run of ``name`` at the base (``links``) or the head (None), in a fresh process."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if links is not None:
        env = importing(links, env)
    job = dict(workload=name, model=str(model), vocab=vocab, threads=threads)
    # Outside the checkout, so its folders (kernels/, core/) shadow nothing.
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(job)], cwd="/tmp",
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{name} at {'base' if links else 'head'} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    expected = links if links is not None else ROOT / "core"
    assert Path(result["source"]).is_relative_to(expected), (result["source"], expected)
    return result


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    sys.path.insert(0, str(HERE))
    import throughput
    from cpu_flags import cpu_summary

    commit, tree = checkout(args.base)
    links = import_links(tree)
    head = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"== layerzoo {commit[:10]} (base) vs {head} (head) | {cpu_summary()} | threads {args.threads} | "
          f"load avg {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores ==")
    rows = []
    for name in args.workloads.split(","):
        spec = WORKLOADS[name]
        shape = throughput.model_shape(throughput.parse_args(["--size", spec["size"], "--arch", spec["arch"]]))
        model = throughput.build_checkpoint(shape, "float32", arch=spec["arch"])
        got = {"base": [], "head": []}
        for _ in range(args.rounds):
            for side in ("base", "head"):
                got[side].append(run(name, model, shape["vocab"], args.threads, links if side == "base" else None))
        speed = {side: (statistics.median(r["generated"] / r["wall_s"] for r in runs),
                        statistics.median(r["generated"] / r["cpu_s"] for r in runs)) for side, runs in got.items()}
        same = got["base"][0]["tokens"] == got["head"][0]["tokens"]
        rows.append([name, f"{speed['base'][0]:.1f}", f"{speed['head'][0]:.1f}", f"{speed['head'][0] / speed['base'][0]:.2f}",
                     f"{speed['base'][1]:.1f}", f"{speed['head'][1]:.1f}", f"{speed['head'][1] / speed['base'][1]:.2f}",
                     "yes" if same else "NO"])
        print(f"  {name}: done", flush=True)
    header = ["workload", "base tok/s", "head tok/s", "head/base", "base tok/cpu-s", "head tok/cpu-s", "head/base", "same tokens"]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    for r in [header, ["-" * w for w in widths], *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    print(f"(medians of {args.rounds} runs each, in turns; load avg at the end {os.getloadavg()[0]:.2f})")


if __name__ == "__main__":
    main()
