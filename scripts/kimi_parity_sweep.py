"""Greedy parity of random Kimi Linear shapes beyond the test suite: two requests sharing part of a
prompt (a prefix hit on cached latents and KDA snapshots), chunked at odd budgets and block sizes,
with n-gram speculation on, against transformers. Prints one line per shape and the count identical.

    python scripts/kimi_parity_sweep.py [--shapes 12]

Uses the kimi_k3 plugin test suite's checkpoint builders (transformers is needed, as for the tests).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import tempfile
import types
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "plugins" / "kimi_k3" / "tests"
GREEDY_TOKENS = 10


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check(conftest, parity, config, seed: int, mla_prefill: str) -> bool:
    from layerzoo import LLM, SamplingParams

    path = tempfile.mkdtemp()
    hf_model = conftest.save_tiny(path, config, seed=seed)
    vocab, rng = config.vocab_size, random.Random(seed)
    first = [rng.randrange(vocab) for _ in range(rng.randrange(66, 140))]
    second = first[: rng.randrange(33, len(first))] + [rng.randrange(vocab) for _ in range(rng.randrange(5, 30))]
    short = [rng.randrange(vocab) for _ in range(5)] * 2  # repeats: the n-gram proposer drafts
    llm = LLM(path, dtype="float32", max_num_batched_tokens=rng.choice([24, 37, 50]), block_size=rng.choice([8, 16]),
              max_model_len=512, ssm_snapshot_interval=1, mla_prefill=mla_prefill,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = []
    for batch in ([first, short], [second, short]):  # the second batch resumes from the first's blocks
        outs += [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]
    expected = [parity.hf_greedy(hf_model, p, GREEDY_TOKENS) for p in (first, short, second, short)]
    stats = llm.engine.stats
    same = outs == expected
    print(f"seed {seed:2d} {mla_prefill:5s} layers {config.layer_types}: {'identical' if same else 'DIFFERENT'}; "
          f"prefix block hits {stats.prefix_cache_hits}, state snapshot hits {stats.state_snapshot_hits}, "
          f"verifies {stats.spec_verify_steps}", flush=True)
    return same


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", type=int, default=12, help="random shapes (seeds from 2 on; 0-1 are the test suite's)")
    p.add_argument("--local", type=int, default=2, help="of those, how many also run with mla_prefill='local'")
    args = p.parse_args(argv)
    conftest = load("kimi_conftest", TESTS / "conftest.py")
    parity = load("kimi_parity", TESTS / "test_parity.py")
    helpers = types.SimpleNamespace(save_tiny=conftest.save_tiny, kimi_config=conftest.kimi_config)
    results = []
    for i, seed in enumerate(range(2, 2 + args.shapes)):
        config = parity.random_config(seed, helpers)
        results.append(check(conftest, parity, config, seed, "paged"))
        if i < args.local:
            results.append(check(conftest, parity, parity.random_config(seed, helpers), seed, "local"))
    print(f"{sum(results)}/{len(results)} identical")


if __name__ == "__main__":
    main()
