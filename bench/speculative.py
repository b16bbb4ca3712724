"""N-gram and MTP speculative decoding vs plain decoding on three workloads, in the same run.

1. ``rewrite``: the kind prompt lookup is for: code whose identifiers repeat, and requests to
   rewrite a given block (the answer copies long spans of the prompt); the embedded model.
2. ``low-acceptance``: a random-weight model (bench/throughput.py's ``tiny`` Qwen3 with a
   512-token vocabulary, random init) given a repeated phrase: the n-gram proposer finds matches but the model rarely follows
   them, so fixed-k speculation pays for verifies that accept little.

3. ``stdlib``: the embedded model continuing the first lines of standard-library modules its
   training left out (the held-out split of scripts/make_default_model.py): its own kind of text,
   where its trained MTP head (``mtp.safetensors``) drafts and n-gram lookup finds little.

Each workload runs at one request and at six (``--batch``): one stream is where speculation is
meant to pay (a few-row step costs little more than one row); six decoding rows already keep this
kind of CPU's fp32 GEMV compute-bound (on a 2-core EPYC 24 rows take 3.4x the time of 6), so there
a verify's rows cost about what the tokens they emit would, and adaptive drafting should hold
plain decoding's speed rather than beat it.

Besides wall-clock tokens/s, each row prints its ratio to plain in tokens per CPU second of the
process: on a shared machine other processes stretch wall time (and move the thread policy),
not the CPU time a run spends (bench/revisions.py reads both for the same reason); and the ratio of
the requests' mean latency (arrival to last token): tokens/s is the batch's makespan, which waits
for its slowest stream, while a server's users see each request's own end.

The MTP rows draft with the checkpoint's own head (``{"method": "mtp"}``): the embedded model's
trained one; for the random model, a random head written beside a copy of it
(`layerzoo.testing.checkpoints.add_mtp_head`), which the model never follows.

Each workload runs plain decoding (twice: a second plain engine of the same model, built apart,
shows how far two identical engines of the run differ; on a 2-core EPYC 1-4%, so a row that far
from its target tells nothing), and per method adaptive speculation (the default: per-sequence
draft length from acceptance, layerzoo.speculative.adaptive) and fixed-k speculation
(``adaptive: false``) on the same greedy requests; the script prints tokens/s, the ratio to plain, acceptance, the mean
number of tokens a verify step emits (1 + accepted drafts), drafts proposed, and whether the
outputs are identical to plain decoding. It never asserts timings. Examples::

    python bench/speculative.py                       # all three workloads
    python bench/speculative.py --workload stdlib --mtp-k 1 2 3
    python bench/speculative.py --model PATH --k 4    # the rewrite workload on any checkpoint
    python bench/speculative.py --batch 1             # one request at a time only (latency)
    LAYERZOO_CPU_MARCH=haswell ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python bench/speculative.py
                                                      # the AVX2 code paths on an AVX-512 host
"""

from __future__ import annotations

import argparse
import statistics
import time

SNIPPETS = [
    '''def read_config(path):
    with open(path) as handle:
        config = json.load(handle)
    if "name" not in config:
        raise KeyError("name")
    return config


def write_config(path, config):
    with open(path, "w") as handle:
        json.dump(config, handle)
''',
    '''class Buffer:
    def __init__(self, size):
        self.size = size
        self.data = []

    def append(self, item):
        if len(self.data) >= self.size:
            self.data.pop(0)
        self.data.append(item)
''',
    '''import os
import sys


def main(argv):
    for name in os.listdir(argv[1]):
        path = os.path.join(argv[1], name)
        if os.path.isfile(path):
            print(path, os.path.getsize(path))
''',
]


def workload(batch: int) -> list[str]:
    """Rewrite-this-block prompts: the block, then its first lines again to continue from."""
    prompts = []
    for i in range(batch):
        block = SNIPPETS[i % len(SNIPPETS)]
        head = "\n".join(block.splitlines()[:2]) + "\n"
        prompts.append(f"# original\n{block}\n# the same code, rewritten\n{head}")
    return prompts


def run(llm, prompts, params):
    """``(outputs, tokens per wall second, tokens per CPU second of this process, mean seconds from
    a request's arrival to its last token)``."""
    start, cpu = time.perf_counter(), time.process_time()
    outs = llm.generate(prompts, params)
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    latency = statistics.fmean(o.metrics["total_s"] for o in outs)
    return [o.outputs[0].token_ids for o in outs], tokens / elapsed, tokens / cpu, latency


# Modules of the held-out split (the end of the sorted file list) of scripts/make_default_model.py.
HELD_OUT_MODULES = ["xmlrpc/server.py", "zipapp.py", "zipfile.py", "zipimport.py", "zoneinfo/_common.py", "zoneinfo/_tzpath.py"]


def stdlib_prompts(batch: int, lines: int = 12) -> list[str]:
    """The first ``lines`` lines of held-out standard-library modules (the embedded model's own text)."""
    import sysconfig
    from pathlib import Path

    root = Path(sysconfig.get_paths()["stdlib"])
    texts = ["".join((root / name).read_text(encoding="utf-8").splitlines(keepends=True)[:lines]) for name in HELD_OUT_MODULES]
    return [texts[i % len(texts)] for i in range(batch)]


def with_random_head(path):
    """A copy of the checkpoint at ``path`` with a random Qwen3-Next-layout MTP head (cached beside it)."""
    import json
    import shutil

    from layerzoo.testing.checkpoints import add_mtp_head

    dst = path.with_name(path.name + "-mtp")
    if not (dst / "config.json").is_file() or "mtp_num_hidden_layers" not in json.loads((dst / "config.json").read_text()):
        shutil.rmtree(dst, ignore_errors=True)
        shutil.copytree(path, dst)
        layers = json.loads((path / "config.json").read_text())["num_hidden_layers"]
        add_mtp_head(dst, "qwen", source_layer=layers - 1)
    return dst


def random_model_dir():
    """bench/throughput.py's cached random ``tiny`` Qwen3 (built on first use)."""
    import throughput  # bench/ is sys.path[0] when run as a script

    # A small vocabulary: the last token recurs often, so the n-gram proposer drafts nearly every
    # step, and the random model rarely continues the way the earlier occurrence did.
    args = throughput.parse_args(["--size", "tiny", "--vocab", "512"])
    return throughput.build_checkpoint(throughput.model_shape(args), "float32")


def low_acceptance_prompts(batch: int, vocab: int) -> list[list[int]]:
    """A phrase of random token ids said three times: the n-gram proposer always finds a match."""
    import random

    rng = random.Random(0)
    prompts = []
    for _ in range(batch):
        phrase = [rng.randrange(1, vocab) for _ in range(12)]
        prompts.append(phrase * 3)
    return prompts


def measure(engines, prompts, params, repeats):
    """Per engine: its tokens/s in each of ``repeats`` rounds, the last outputs, and the speculation
    counters of one run. In a round every engine runs once, back to back, in an order that reverses
    from round to round, so that a change in the machine's speed (other processes, frequency)
    reaches all of them alike and the ratios of one round compare runs a fraction of a second apart."""
    tps = {label: [] for label in engines}
    per_cpu = {label: [] for label in engines}
    latency = {label: [] for label in engines}
    outs, counters = {}, {}
    for round_ in range(repeats):
        order = list(engines.items())
        for label, llm in order if round_ % 2 == 0 else order[::-1]:
            st = llm.engine.stats
            before = st.spec_verify_steps, st.spec_draft_tokens, st.spec_accepted_tokens
            outs[label], rate, cpu_rate, seconds = run(llm, prompts, params)
            tps[label].append(rate)
            per_cpu[label].append(cpu_rate)
            latency[label].append(seconds)
            counters[label] = [now - was for now, was in zip((st.spec_verify_steps, st.spec_draft_tokens, st.spec_accepted_tokens), before)]
    return {label: (tps[label], per_cpu[label], latency[label], outs[label], counters[label]) for label in engines}


def workload_table(name, engines, prompts, params, repeats) -> None:
    for llm in engines.values():
        run(llm, prompts, params)  # warm-up (weights, allocator, first prefix)
    results = measure(engines, prompts, params, repeats)
    plain_tps, plain_cpu, plain_latency, plain_out, _ = results["plain"]
    print(f"\n== {name} ==")
    print(f"{'engine':22s} {'tok/s':>8s} {'vs plain':>9s} {'spread':>11s} {'per CPU-s':>10s} {'latency':>8s} {'verifies':>9s} "
          f"{'drafts':>7s} {'accepted':>9s} {'tok/verify':>10s}  identical")
    for label, (tps, cpu, latency, outs, (verifies, drafted, accepted)) in results.items():
        rate = f"{accepted / drafted:.0%}" if drafted else "-"
        per_verify = f"{1 + accepted / verifies:.2f}" if verifies else "-"
        ratios = sorted(t / p for t, p in zip(tps, plain_tps))  # per round: runs a moment apart
        spread = f"{ratios[len(ratios) // 4]:.2f}-{ratios[(3 * len(ratios)) // 4]:.2f}"
        cpu_ratio = statistics.median(c / p for c, p in zip(cpu, plain_cpu))
        latency_ratio = statistics.median(p / s for s, p in zip(latency, plain_latency))
        print(f"{label:22s} {statistics.median(tps):8.1f} {statistics.median(ratios):8.2f}x {spread:>11s} {cpu_ratio:9.2f}x "
              f"{latency_ratio:7.2f}x {verifies:9d} {drafted:7d} {rate:>9s} {per_verify:>10s}  {outs == plain_out}")
    print("vs plain: the median over rounds of the round's tok/s ratio; spread: its quartiles; per CPU-s: the same ratio of\n"
          "tokens per CPU second of this process (what other processes on a shared machine leave alone; with more than one\n"
          "thread it also counts threads waiting at barriers); latency: plain's mean seconds from a request's arrival to its\n"
          "last token over the engine's, per round (> 1: requests finish sooner on average; in a batch, streams that finish\n"
          "early count even when the batch's last one does not); plain, built again: the plain engine a second time, whose\n"
          "distance from 1.00x is this run's own spread between identical engines (where each one's memory landed, the host)")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local checkpoint for the rewrite workload (default: the embedded model)")
    p.add_argument("--batch", type=int, nargs="+", default=[1, 6],
                   help="concurrent requests, a table each (default 1 6: one stream's latency, where speculation is meant to pay, "
                        "and a batch, where the CPU's rows are compute-bound)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--n", type=int, default=3, help="prompt_lookup_max")
    p.add_argument("--repeats", type=int, default=15, help="rounds of timed runs, the engines taking turns (medians are kept)")
    p.add_argument("--mtp-k", type=int, nargs="+", default=[1, 3], help="num_speculative_tokens of the MTP rows (default: 1 3)")
    p.add_argument("--workload", choices=["all", "rewrite", "low-acceptance", "stdlib"], default="all")
    args = p.parse_args(argv)

    from cpu_flags import cpu_summary  # noqa: E402  (bench/ is sys.path[0] when run as a script)

    from layerzoo import LLM, SamplingParams
    from layerzoo.loading.model_packages import DEFAULT_MODEL

    print(cpu_summary())
    import os

    print(f"load avg {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores (shared machines: compare ratios within one run)")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def engines(model, mtp_model=None):
        """Plain, n-gram adaptive / fixed and, where ``mtp_model`` (the checkpoint with a head) is
        given, MTP adaptive / fixed."""
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.n}
        out = {
            "plain": LLM(model, dtype="float32"),
            # The same engine built again: how far two identical engines of this run differ.
            "plain, built again": LLM(model, dtype="float32"),
            f"ngram adaptive k<={args.k}": LLM(model, dtype="float32", speculative_config=spec),
            f"ngram fixed k={args.k}": LLM(model, dtype="float32", speculative_config={**spec, "adaptive": False}),
        }
        for k in args.mtp_k if mtp_model is not None else ():
            mtp = {"method": "mtp", "num_speculative_tokens": k}
            out[f"mtp adaptive k<={k}"] = LLM(mtp_model, dtype="float32", speculative_config=mtp)
            out[f"mtp fixed k={k}"] = LLM(mtp_model, dtype="float32", speculative_config={**mtp, "adaptive": False})
        return out

    def has_head(model) -> bool:
        import json
        from pathlib import Path

        config = json.loads((Path(model or DEFAULT_MODEL) / "config.json").read_text())
        return bool(config.get("mtp_num_hidden_layers") or config.get("num_nextn_predict_layers"))

    print(f"{' and '.join(map(str, args.batch))} requests x {args.max_tokens} tokens, greedy, EOS ignored; ngram k={args.k} "
          f"n={args.n}, mtp k={' and '.join(map(str, args.mtp_k))}; {args.repeats} rounds, engines taking turns")

    def tables(name, built, prompts_for):
        for batch in args.batch:
            workload_table(f"{name}; {batch} request{'s' if batch > 1 else ''} at once", built, prompts_for(batch), params, args.repeats)

    if args.workload in ("all", "rewrite"):
        tables(f"rewrite: {args.model or 'embedded model'}, rewrite-this-code prompts",
               engines(args.model, (args.model or str(DEFAULT_MODEL)) if has_head(args.model) else None), workload)
    if args.workload in ("all", "low-acceptance"):
        path = random_model_dir()
        import json

        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        tables(f"low acceptance: random-weight model {path.name} (MTP: a random head), a phrase said three times",
               engines(str(path), str(with_random_head(path))),
               lambda batch: [{"prompt_token_ids": ids} for ids in low_acceptance_prompts(batch, vocab)])
    if args.workload in ("all", "stdlib"):
        tables("stdlib: embedded model, first lines of held-out standard-library modules",
               engines(str(DEFAULT_MODEL), str(DEFAULT_MODEL)), stdlib_prompts)

if __name__ == "__main__":
    main()
