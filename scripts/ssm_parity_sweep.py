"""Greedy parity of random Qwen3-Next / Qwen3.5 / Mamba2 shapes beyond the test suite, with a
prefix-cache hit on every one: two requests sharing part of a prompt, chunked at odd budgets and
block sizes, against transformers. Prints one line per shape and the count identical.

    python scripts/ssm_parity_sweep.py [--gdn 10] [--mamba2 6]

Uses the ssm plugin test suite's checkpoint builders (transformers is needed, as for the tests).
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import tempfile
import types
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "plugins" / "ssm" / "tests"
GREEDY_TOKENS = 10


def load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mamba2_config(transformers, seed: int):
    rng = random.Random(seed)
    head_dim, heads = rng.choice([8, 12, 16]), rng.choice([4, 6, 8])
    return transformers.Mamba2Config(
        vocab_size=rng.randrange(100, 200), hidden_size=head_dim * heads // 2, num_hidden_layers=rng.randrange(1, 4),
        state_size=rng.choice([4, 8, 16]), head_dim=head_dim, num_heads=heads, expand=2,
        n_groups=rng.choice([g for g in (1, 2) if heads % g == 0]), conv_kernel=rng.choice([2, 3, 4]),
        chunk_size=rng.choice([16, 32, 64]), tie_word_embeddings=rng.random() < 0.5,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )


def check(conftest, parity, model_cls, config, seed: int) -> bool:
    from layerzoo import LLM, SamplingParams

    path = tempfile.mkdtemp()
    hf_model = conftest.save_tiny(path, model_cls, config, seed=seed)
    vocab, rng = config.vocab_size, random.Random(seed)
    first = [rng.randrange(vocab) for _ in range(rng.randrange(66, 140))]
    second = first[: rng.randrange(33, len(first))] + [rng.randrange(vocab) for _ in range(rng.randrange(5, 30))]
    short = [rng.randrange(vocab) for _ in range(5)]
    llm = LLM(path, dtype="float32", max_num_batched_tokens=rng.choice([24, 37, 50]), block_size=rng.choice([8, 16]),
              max_model_len=512, ssm_snapshot_interval=1)
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, ignore_eos=True)
    outs = []
    for batch in ([first, short], [second, short]):  # the second batch resumes from the first's blocks
        outs += [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], params)]
    expected = [parity.hf_greedy(hf_model, p, GREEDY_TOKENS) for p in (first, short, second, short)]
    stats = llm.engine.stats
    same = outs == expected
    print(f"{model_cls.__name__:22s} seed {seed:2d}: {'identical' if same else 'DIFFERENT'}; "
          f"state snapshot hits {stats.state_snapshot_hits}, prefix block hits {stats.prefix_cache_hits}", flush=True)
    return same


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gdn", type=int, default=10, help="random Qwen3-Next / Qwen3.5 shapes (seeds from 3 on)")
    p.add_argument("--mamba2", type=int, default=6, help="random Mamba2 shapes")
    args = p.parse_args(argv)

    import transformers

    conftest = load("ssm_conftest", TESTS / "conftest.py")
    parity = load("ssm_parity", TESTS / "test_gdn_parity.py")
    helpers = types.SimpleNamespace(
        save_tiny=conftest.save_tiny, next_config=conftest.next_config, qwen3_5_text_config=conftest.qwen3_5_text_config
    )
    results = []
    for seed in range(3, 3 + args.gdn):  # seeds 0-2 are the test suite's
        model_cls, config = parity.random_config(seed, helpers)
        results.append(check(conftest, parity, model_cls, config, seed))
    for seed in range(args.mamba2):
        results.append(check(conftest, parity, transformers.Mamba2ForCausalLM, mamba2_config(transformers, seed), seed))
    print(f"{sum(results)}/{len(results)} identical")


if __name__ == "__main__":
    main()
