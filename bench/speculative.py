"""N-gram speculative decoding vs plain decoding on two workloads, in the same run.

1. ``rewrite``: the kind prompt lookup is for: code whose identifiers repeat, and requests to
   rewrite a given block (the answer copies long spans of the prompt); the embedded model.
2. ``low-acceptance``: a random-weight model (bench/throughput.py's ``tiny`` Qwen3 with a
   512-token vocabulary, random init) given a repeated phrase: the n-gram proposer finds matches but the model rarely follows
   them, so fixed-k speculation pays for verifies that accept little.

Each workload runs plain decoding, adaptive speculation (the default: per-sequence draft length
from acceptance, layerzoo.speculative.adaptive) and fixed-k speculation (``adaptive: false``) on
the same greedy requests; the script prints tokens/s, the ratio to plain, acceptance, the mean
number of tokens a verify step emits (1 + accepted drafts), drafts proposed, and whether the
outputs are identical to plain decoding. It never asserts timings. Examples::

    python bench/speculative.py                       # both workloads
    python bench/speculative.py --model PATH --k 4    # the rewrite workload on any checkpoint
    python bench/speculative.py --batch 1             # one request at a time (latency)
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
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return [o.outputs[0].token_ids for o in outs], tokens / elapsed, elapsed


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
    outs, counters = {}, {}
    for round_ in range(repeats):
        order = list(engines.items())
        for label, llm in order if round_ % 2 == 0 else order[::-1]:
            st = llm.engine.stats
            before = st.spec_verify_steps, st.spec_draft_tokens, st.spec_accepted_tokens
            outs[label], rate, _ = run(llm, prompts, params)
            tps[label].append(rate)
            counters[label] = [now - was for now, was in zip((st.spec_verify_steps, st.spec_draft_tokens, st.spec_accepted_tokens), before)]
    return {label: (tps[label], outs[label], counters[label]) for label in engines}


def workload_table(name, engines, prompts, params, repeats) -> None:
    for llm in engines.values():
        run(llm, prompts, params)  # warm-up (weights, allocator, first prefix)
    results = measure(engines, prompts, params, repeats)
    plain_tps, plain_out, _ = results["plain"]
    print(f"\n== {name} ==")
    print(f"{'engine':22s} {'tok/s':>8s} {'vs plain':>9s} {'spread':>11s} {'verifies':>9s} {'drafts':>7s} {'accepted':>9s} "
          f"{'tok/verify':>10s}  identical")
    for label, (tps, outs, (verifies, drafted, accepted)) in results.items():
        rate = f"{accepted / drafted:.0%}" if drafted else "-"
        per_verify = f"{1 + accepted / verifies:.2f}" if verifies else "-"
        ratios = sorted(t / p for t, p in zip(tps, plain_tps))  # per round: runs a moment apart
        spread = f"{ratios[len(ratios) // 4]:.2f}-{ratios[(3 * len(ratios)) // 4]:.2f}"
        print(f"{label:22s} {statistics.median(tps):8.1f} {statistics.median(ratios):8.2f}x {spread:>11s} {verifies:9d} "
              f"{drafted:7d} {rate:>9s} {per_verify:>10s}  {outs == plain_out}")
    print("vs plain: the median over rounds of the round's tok/s ratio; spread: its quartiles")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local checkpoint for the rewrite workload (default: the embedded model)")
    p.add_argument("--batch", type=int, default=6, help="concurrent requests (default 6)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--n", type=int, default=3, help="prompt_lookup_max")
    p.add_argument("--repeats", type=int, default=15, help="rounds of timed runs, the engines taking turns (medians are kept)")
    p.add_argument("--workload", choices=["both", "rewrite", "low-acceptance"], default="both")
    args = p.parse_args(argv)

    from cpu_flags import cpu_summary  # noqa: E402  (bench/ is sys.path[0] when run as a script)

    from layerzoo import LLM, SamplingParams

    print(cpu_summary())
    import os

    print(f"load avg {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores (shared machines: compare ratios within one run)")
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)

    def engines(model):
        spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.n}
        return {
            "plain": LLM(model, dtype="float32"),
            f"adaptive k<={args.k}": LLM(model, dtype="float32", speculative_config=spec),
            f"fixed k={args.k}": LLM(model, dtype="float32", speculative_config={**spec, "adaptive": False}),
        }

    print(f"{args.batch} requests x {args.max_tokens} tokens, greedy, EOS ignored; ngram k={args.k} n={args.n}; "
          f"{args.repeats} rounds, engines taking turns")
    if args.workload in ("both", "rewrite"):
        workload_table(f"rewrite: {args.model or 'embedded model'}, rewrite-this-code prompts", engines(args.model),
                       workload(args.batch), params, args.repeats)
    if args.workload in ("both", "low-acceptance"):
        path = random_model_dir()
        import json

        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        prompts = [{"prompt_token_ids": ids} for ids in low_acceptance_prompts(args.batch, vocab)]
        workload_table(f"low acceptance: random-weight model {path.name}, a phrase said three times",
                       engines(str(path)), prompts, params, args.repeats)


if __name__ == "__main__":
    main()
