"""`layerzoo serve` under N concurrent streaming clients (the real `openai` client), a third of
them disconnecting mid-stream.

Starts ``layerzoo serve`` on 127.0.0.1 (a free port; loopback only), runs N clients at once
(default 64), each streaming a greedy completion; every third client closes its stream after a
few chunks. Prints requests/s, output tokens/s and time to first token (p50/p99), then checks:

- every completed stream's text equals the offline greedy output (`LLM.generate`, same model);
- afterwards the engine holds no request, KV block or decode slot (read from ``/metrics``).

Exits 1 if a check fails. Bounded: ``--timeout`` seconds for the whole run; the server is killed
at the end.

    python bench/serve.py                       # 64 clients, 32 tokens each
    python bench/serve.py --clients 16 --max-tokens 16
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import openai

from layerzoo.server.process import ServerProcess

PROMPTS = [f"def {name}(self, value):\n    " for name in (
    "parse", "update", "close", "send", "read", "write", "reset", "flush", "encode", "decode", "split", "join",
    "start", "stop", "run", "check")]


async def client(api: openai.AsyncOpenAI, i: int, prompt: str, max_tokens: int, disconnect_after: int | None) -> dict:
    """One streaming completion; returns its text, TTFT, token count and whether it completed."""
    began = time.perf_counter()
    ttft, text, chunks, usage = None, "", 0, None
    stream = await api.completions.create(model="layerzoo", prompt=prompt, max_tokens=max_tokens, temperature=0,
                                          stream=True, stream_options={"include_usage": True})
    try:
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].text:
                ttft = ttft if ttft is not None else time.perf_counter() - began
                text += chunk.choices[0].text
                chunks += 1
                if disconnect_after is not None and chunks >= disconnect_after:
                    return {"i": i, "completed": False, "ttft": ttft}
    finally:
        await stream.close()
    return {"i": i, "completed": True, "ttft": ttft, "text": text,
            "tokens": usage.completion_tokens if usage else 0, "prompt": prompt}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


def offline_greedy(max_tokens: int) -> dict[str, str]:
    from layerzoo.llm import LLM
    from layerzoo.sampling import SamplingParams

    outs = LLM().generate(PROMPTS, SamplingParams(temperature=0, max_tokens=max_tokens), use_tqdm=False)
    return {p: o.outputs[0].text for p, o in zip(PROMPTS, outs)}


async def load(url: str, args) -> tuple[list[dict], float]:
    api = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=args.timeout)
    jobs = [
        client(api, i, PROMPTS[i % len(PROMPTS)], args.max_tokens, args.disconnect_after if i % 3 == 2 else None)
        for i in range(args.clients)
    ]
    began = time.perf_counter()
    results = await asyncio.gather(*jobs)
    wall = time.perf_counter() - began
    await api.close()
    return results, wall


def wait_idle(server: ServerProcess, timeout: float = 30) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    while True:
        m = server.metrics()
        held = (m["layerzoo:num_requests_held"], m["layerzoo:kv_cache_blocks_in_use"], m["layerzoo:decode_slots_in_use"])
        if held == (0, 0, 0) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--disconnect-after", type=int, default=3, help="chunks a disconnecting client reads")
    parser.add_argument("--timeout", type=float, default=600, help="seconds for the whole load")
    parser.add_argument("--serve-flags", default="", help="extra flags for layerzoo serve")
    args = parser.parse_args()

    reference = offline_greedy(args.max_tokens)
    with ServerProcess(*args.serve_flags.split()) as server:
        results, wall = asyncio.run(asyncio.wait_for(load(server.url, args), args.timeout))
        after = wait_idle(server)
    completed = [r for r in results if r["completed"]]
    dropped = len(results) - len(completed)
    ttfts = [r["ttft"] for r in results if r["ttft"] is not None]
    tokens = sum(r["tokens"] for r in completed)
    mismatched = [r["i"] for r in completed if r["text"] != reference[r["prompt"]]]
    print(f"{args.clients} streaming clients ({dropped} disconnecting after {args.disconnect_after} chunks), "
          f"{args.max_tokens} greedy tokens each, embedded model, 127.0.0.1")
    print(f"  wall {wall:.2f} s   requests/s {len(completed) / wall:.2f}   output tokens/s {tokens / wall:.1f}")
    print(f"  TTFT p50 {percentile(ttfts, 50) * 1000:.0f} ms   p99 {percentile(ttfts, 99) * 1000:.0f} ms")
    print(f"  completed streams equal to offline greedy: {len(completed) - len(mismatched)}/{len(completed)}"
          + (f" (mismatched clients: {mismatched})" if mismatched else ""))
    held = {k.removeprefix("layerzoo:"): after[k] for k in
            ("layerzoo:num_requests_held", "layerzoo:kv_cache_blocks_in_use", "layerzoo:decode_slots_in_use")}
    print(f"  afterwards: {held}")
    ok = not mismatched and not any(held.values())
    print("OK" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
