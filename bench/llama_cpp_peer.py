"""llama.cpp as a benchmark peer, run by bench/throughput.py in llama-cpp-python's own venv.

Usage: ``python llama_cpp_peer.py JOB.json`` (run from a directory outside the repository: the
repository's ``kernels/`` folder would shadow packages). The job names a GGUF file, the prompts
(token ids), the output lengths, the thread count and a mode:

* ``sequential``: one request after another through the high-level ``Llama.generate`` (greedy:
  top_k=1), each timed from its prompt to its last token (single stream);
* ``batched``: every request in one llama.cpp context, one sequence id each, all prompts then all
  decode steps submitted as ``llama_batch``es (llama.cpp's own multi-sequence batching), greedy.

EOS is ignored: each request produces exactly its output length. Prints one JSON line: wall_s,
generated, tokens and per-request first-token / total times.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time

import llama_cpp
import numpy as np


def load(job):
    """The high-level model and context, sized for one stream; ``extra_bufts: false`` keeps the
    weights in plain CPU buffers (no AMX or repacked copies)."""
    if not job.get("extra_bufts", True):
        default = llama_cpp.llama_model_default_params

        def plain_buffers():
            params = default()
            params.use_extra_bufts = False
            return params

        llama_cpp.llama_model_default_params = plain_buffers
        llama_cpp.llama.llama_cpp.llama_model_default_params = plain_buffers
    return llama_cpp.Llama(
        model_path=job["model"], n_ctx=job["max_len"] + 64, n_batch=512, n_ubatch=512, n_threads=job["threads"],
        n_threads_batch=job["threads"], verbose=False, logits_all=False,
    )


def batched_context(llm, job):
    """A second context on the same weights holding one sequence per request (``n_seq_max``; the
    high-level ``Llama`` makes single-sequence contexts), its KV cache one buffer for all of them."""
    params = llama_cpp.llama_context_default_params()
    params.n_ctx = sum(len(p) + n for p, n in zip(job["prompts"], job["outs"])) + 64
    params.n_batch = params.n_ubatch = 512
    params.n_seq_max = len(job["prompts"])
    params.n_threads = params.n_threads_batch = job["threads"]
    params.kv_unified = True
    ctx = llama_cpp.llama_init_from_model(llm._model.model, params)
    if not ctx:
        raise RuntimeError("llama_init_from_model failed")
    return ctx


def run_sequential(job) -> dict:
    llm = load(job)
    list(zip(range(2), llm.generate([1, 2, 3], top_k=1, temp=0.0, reset=True)))  # warm-up
    tokens, firsts, totals = [], [], []
    t0 = time.perf_counter()
    for prompt, n in zip(job["prompts"], job["outs"]):
        llm.reset()  # else generate() reuses the previous run's KV for a shared prefix (a repeated prompt is free)
        start = time.perf_counter()
        out = []
        for tok in llm.generate(prompt, top_k=1, temp=0.0, repeat_penalty=1.0, reset=True):
            out.append(int(tok))
            if len(out) == 1:
                firsts.append(time.perf_counter() - start)
            if len(out) == n:
                break
        totals.append(time.perf_counter() - start)
        tokens.append(out)
    return dict(wall_s=time.perf_counter() - t0, generated=sum(map(len, tokens)), tokens=tokens, first_s=firsts, total_s=totals)


def submit(ctx, batch, entries) -> None:
    """Decode ``entries`` = [(token, pos, seq, wants_logits)] as one llama_batch."""
    for i, (tok, pos, seq, logits) in enumerate(entries):
        batch.token[i] = tok
        batch.pos[i] = pos
        batch.n_seq_id[i] = 1
        batch.seq_id[i][0] = seq
        batch.logits[i] = logits
    batch.n_tokens = len(entries)
    rc = llama_cpp.llama_decode(ctx, batch)
    if rc != 0:
        raise RuntimeError(f"llama_decode returned {rc}")


def run_batched(job) -> dict:
    prompts, outs = job["prompts"], job["outs"]
    llm = load(job)
    ctx, vocab = batched_context(llm, job), llm.n_vocab()
    limit = 512
    batch = llama_cpp.llama_batch_init(limit, 0, len(prompts))

    def argmax(row: int) -> int:
        logits = llama_cpp.llama_get_logits_ith(ctx, row)
        return int(np.argmax(np.ctypeslib.as_array(ctypes.cast(logits, ctypes.POINTER(ctypes.c_float)), shape=(vocab,))))

    def clear():
        mem = llama_cpp.llama_get_memory(ctx)
        llama_cpp.llama_memory_clear(mem, True)

    # warm-up
    submit(ctx, batch, [(1, 0, 0, False), (2, 1, 0, True)])
    clear()
    t0 = time.perf_counter()
    tokens = [[] for _ in prompts]
    firsts = [0.0] * len(prompts)
    # Prefill: prompts packed into batches of at most `limit` tokens; a prompt's last row gives logits.
    pending = [(tok, pos, s, pos == len(p) - 1) for s, p in enumerate(prompts) for pos, tok in enumerate(p)]
    for start in range(0, len(pending), limit):
        chunk = pending[start:start + limit]
        submit(ctx, batch, chunk)
        for row, (_, pos, s, last) in enumerate(chunk):
            if last:
                tokens[s].append(argmax(row))
                firsts[s] = time.perf_counter() - t0
    # Decode: one token per unfinished sequence per step.
    while True:
        live = [s for s in range(len(prompts)) if len(tokens[s]) < outs[s]]
        if not live:
            break
        submit(ctx, batch, [(tokens[s][-1], len(prompts[s]) + len(tokens[s]) - 1, s, True) for s in live])
        for row, s in enumerate(live):
            tokens[s].append(argmax(row))
    wall = time.perf_counter() - t0
    llama_cpp.llama_batch_free(batch)
    llama_cpp.llama_free(ctx)
    return dict(wall_s=wall, generated=sum(map(len, tokens)), tokens=tokens, first_s=firsts)


def main(path: str) -> None:
    job = json.loads(open(path).read())
    result = run_batched(job) if job["mode"] == "batched" else run_sequential(job)
    result["llama_cpp_version"] = llama_cpp.__version__
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
