"""Structured outputs' cost: constrained vs unconstrained decode tokens/s at batch 8, in turns.

Both sides generate exactly ``--tokens`` tokens per request, greedy, from the same prompts: the
unconstrained side with ``ignore_eos``, the constrained side under a JSON schema whose shortest
document is longer than that (an array of at least 64 objects), so EOS is never allowed and every
request runs to ``max_tokens``. The constrained steps pay for the grammar work (bringing each
matcher up to its tokens, one bitmask for the batch from llguidance's executor) and the mask
kernel. The turns alternate so that both sides see the same machine; the script prints each
turn, the medians and the ratio (target: constrained >= 0.9x unconstrained). It never asserts
timings. Examples::

    python bench/structured_outputs.py                       # the embedded model, batch 8
    python bench/structured_outputs.py --model PATH --batch 16 --tokens 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "minItems": 64,
            "items": {
                "type": "object",
                "properties": {"name": {"type": "string", "maxLength": 12}, "value": {"type": "integer"}},
                "required": ["name", "value"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}

PROMPTS = [
    "Return the inventory as JSON:\n",
    "import json\nrecords = ",
    "# the measurements, one object each\n",
    "def load():\n    return ",
]


def run(llm, prompts, params) -> tuple[float, int, list]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    return tokens / elapsed, tokens, outs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint directory or hub id (default: the embedded model)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128, help="tokens generated per request")
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default=None)
    parser.add_argument("--parallel-rows", type=int, default=None,
                        help="masks on llguidance's thread pool from this many constrained rows a step (default: the engine's)")
    args = parser.parse_args()

    from layerzoo import LLM
    from layerzoo.sampling import SamplingParams, StructuredOutputsParams

    llm = LLM(args.model, dtype=args.dtype, **({"device": args.device} if args.device else {}))
    if args.parallel_rows is not None:
        llm.engine.structured_outputs.parallel_rows = args.parallel_rows
    prompts = [PROMPTS[i % len(PROMPTS)] + f"# {i}\n" for i in range(args.batch)]
    plain = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0, max_tokens=args.tokens, structured_outputs=StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    )
    # warm-up: kernels built, the grammar compiled (the cache then serves every turn)
    run(llm, prompts, plain)
    _, _, outs = run(llm, prompts, constrained)
    assert all(len(o.outputs[0].token_ids) == args.tokens for o in outs), "a constrained request ended early"
    sample = outs[0].outputs[0].text
    print(f"model {args.model or 'embedded'}  batch {args.batch}  {args.tokens} tokens/request")
    print(f"constrained sample: {sample[:100]!r}...")

    rates = {"unconstrained": [], "constrained": []}
    for turn in range(args.turns):
        for name, params in (("unconstrained", plain), ("constrained", constrained)):
            rate, tokens, _ = run(llm, prompts, params)
            rates[name].append(rate)
            print(f"turn {turn}  {name:<13} {rate:9.1f} tok/s  ({tokens} tokens)")
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(json.dumps({"unconstrained_tok_s": round(med["unconstrained"], 1), "constrained_tok_s": round(med["constrained"], 1),
                      "ratio": round(med["constrained"] / med["unconstrained"], 3)}))
    print(f"constrained / unconstrained: {med['constrained'] / med['unconstrained']:.3f}x (target >= 0.9x)")


if __name__ == "__main__":
    main()
