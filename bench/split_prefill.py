"""The split prefill's phase 2 against the one-call route: a random tiny Qwen3-Next, a prefill of
mixed prompt lengths in one step, once with the GDN layers answering ``is_ssm_layer`` (every prompt
of the step in one varlen recurrence call per layer) and once with the answer flipped False (one
call per prompt). Prints, per route, the best step time, the time inside the recurrence (phase 2)
and the recurrence kernel calls, then their ratios, and whether the first tokens agree. It never
asserts a timing. Needs transformers (to write the random checkpoint)::

    python bench/split_prefill.py                       # 8 prompts of 7..300 tokens, CPU
    python bench/split_prefill.py --prompts 16 --rounds 7 --threads 1
    python bench/split_prefill.py --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=8, help="prompts in the step (default 8)")
    p.add_argument("--min-len", type=int, default=7)
    p.add_argument("--max-len", type=int, default=300)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds per route, alternating (default 5)")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--head-dim", type=int, default=64, help="linear key and value head dim (default 64)")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    return p.parse_args(argv)


def write_model(path: str, args) -> int:
    import transformers

    from layerzoo.testing import write_word_tokenizer

    config = transformers.Qwen3NextConfig(
        vocab_size=512, hidden_size=args.hidden, intermediate_size=2 * args.hidden, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=args.head_dim,
        linear_value_head_dim=args.head_dim, linear_conv_kernel_dim=4, full_attention_interval=2,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    torch.manual_seed(0)
    transformers.Qwen3NextForCausalLM(config).save_pretrained(path)
    write_word_tokenizer(path, config.vocab_size)
    return config.vocab_size


class NotSsm:
    """Flips the GDN layers' is_ssm_layer to False: the one-call route."""

    def __init__(self):
        from layerzoo import hookimpl
        from layerzoo_ssm import GDN_KIND

        @hookimpl(tryfirst=True)
        def is_ssm_layer(layer_kind):
            return False if layer_kind == GDN_KIND else None

        self.is_ssm_layer = is_ssm_layer


def instrument():
    """Counts recurrence kernel calls and times phase 2 (synchronised); returns the tallies."""
    import layerzoo.layers.recurrent_pool as pool
    import layerzoo.layers.split_prefill as split

    tally = {"calls": 0, "phase2": 0.0}
    lookup, phase2 = pool.kernel, split.recurrence_over_pool

    def kernel(op):
        fn = lookup(op)

        def call(*a, **kw):
            tally["calls"] += op != "delta_rule_decode"
            return fn(*a, **kw)

        return call

    def timed(rec, ctx, varlen):
        sync(rec.v.device)
        t = time.perf_counter()
        out = phase2(rec, ctx, varlen)
        sync(rec.v.device)
        tally["phase2"] += time.perf_counter() - t
        return out

    pool.kernel, split.recurrence_over_pool = kernel, timed
    return tally


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    from layerzoo import LLM, SamplingParams
    from layerzoo.testing import registered_plugin

    rng = random.Random(0)
    lengths = [rng.randint(args.min_len, args.max_len) for _ in range(args.prompts)]
    lengths[0], lengths[-1] = args.min_len, args.max_len
    with tempfile.TemporaryDirectory() as path:
        vocab = write_model(path, args)
        prompts = [[rng.randrange(vocab) for _ in range(n)] for n in lengths]
        engine_args = dict(dtype=args.dtype, device=args.device, max_num_batched_tokens=sum(lengths),
                           enable_prefix_caching=False, max_model_len=args.max_len + 8)
        split = LLM(path, **engine_args)
        with registered_plugin(NotSsm(), "not-ssm"):
            whole = LLM(path, **engine_args)
        tally = instrument()
        params = SamplingParams(max_tokens=1, temperature=0.0)
        best = {"split": [], "one-call": []}
        firsts = {}
        for r in range(args.rounds + 1):
            for name, llm in (("split", split), ("one-call", whole)):
                tally.update(calls=0, phase2=0.0)
                sync(args.device)
                t = time.perf_counter()
                outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
                sync(args.device)
                if r:  # round 0 warms up
                    best[name].append((time.perf_counter() - t, tally["phase2"], tally["calls"]))
                firsts[name] = [o.outputs[0].token_ids for o in outs]
    print(f"{args.prompts} prompts of {sorted(lengths)} tokens ({sum(lengths)} rows), device {args.device}, "
          f"{torch.get_num_threads()} threads, {args.rounds} rounds (min)")
    rows = {name: (min(x[0] for x in v), min(x[1] for x in v), v[0][2]) for name, v in best.items()}
    for name, (step, phase2, calls) in rows.items():
        print(f"  {name:9s} prefill {step * 1e3:8.1f} ms   phase 2 {phase2 * 1e3:8.1f} ms   recurrence calls {calls}")
    (s, s2, _), (w, w2, _) = rows["split"], rows["one-call"]
    print(f"  one-call / split: prefill {w / s:.2f}x, phase 2 {w2 / s2:.2f}x")
    print(f"  first tokens agree: {firsts['split'] == firsts['one-call']}")


if __name__ == "__main__":
    main()
