"""N-gram speculative decoding vs plain decoding on a repetitive workload, in the same run.

The workload is the kind prompt lookup is for: code whose identifiers repeat, and requests to
rewrite a given block (the answer copies long spans of the prompt). Both engines run the same
greedy requests; the script prints tokens/s for each, the ratio, the mean number of tokens a
verify step emits (1 + accepted drafts), and whether the outputs are identical. It never asserts
timings. Examples::

    python bench/speculative.py                       # the embedded default model
    python bench/speculative.py --model PATH --k 4    # any local checkpoint
    python bench/speculative.py --batch 1             # one request at a time (latency)
"""

from __future__ import annotations

import argparse
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


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="a local checkpoint (default: the embedded model)")
    p.add_argument("--batch", type=int, default=6, help="concurrent requests (default 6)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    p.add_argument("--n", type=int, default=3, help="prompt_lookup_max")
    p.add_argument("--repeats", type=int, default=3, help="timed runs per engine (best is kept)")
    args = p.parse_args(argv)

    from layerzoo import LLM, SamplingParams

    prompts = workload(args.batch)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    spec_config = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_max": args.n}
    plain = LLM(args.model, dtype="float32")
    spec = LLM(args.model, dtype="float32", speculative_config=spec_config)
    run(plain, prompts, params), run(spec, prompts, params)  # warm-up (weights, allocator, first prefix)

    best_plain = best_spec = None
    for _ in range(args.repeats):
        out_plain, tps_plain, _ = run(plain, prompts, params)
        before = spec.engine.stats.spec_verify_steps, spec.engine.stats.spec_accepted_tokens, spec.engine.stats.spec_draft_tokens
        out_spec, tps_spec, _ = run(spec, prompts, params)
        st = spec.engine.stats
        verifies, accepted, drafted = (st.spec_verify_steps - before[0], st.spec_accepted_tokens - before[1],
                                       st.spec_draft_tokens - before[2])
        best_plain = max(best_plain or 0, tps_plain)
        best_spec = max(best_spec or 0, tps_spec)

    print(f"model: {args.model or 'embedded default'}; {args.batch} requests x {args.max_tokens} tokens, greedy; "
          f"ngram k={args.k} n={args.n}")
    print(f"plain decoding      : {best_plain:8.1f} tok/s")
    print(f"speculative decoding: {best_spec:8.1f} tok/s")
    print(f"ratio (spec / plain): {best_spec / best_plain:8.2f}x")
    if verifies:
        print(f"last run: {verifies} verifies, {drafted} drafts, {accepted} accepted "
              f"({accepted / max(drafted, 1):.0%}); mean tokens per verify step {1 + accepted / verifies:.2f}")
    print(f"greedy outputs identical: {out_plain == out_spec}")


if __name__ == "__main__":
    main()
