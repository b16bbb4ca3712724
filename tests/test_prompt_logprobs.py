"""``SamplingParams(prompt_logprobs=k)``: vLLM's ``RequestOutput.prompt_logprobs``.

One entry per prompt token: ``None`` for the first (nothing predicts it), then a ``{token_id:
logprob}`` dict (the same shape as ``CompletionOutput.logprobs``' entries) holding the prompt
token's logprob under the model given the tokens before it, plus the top-k ids at that position.
Logprobs of the raw logits, checked against a plain transformers forward over the whole prompt,
through chunked prefill, several requests per step, prefix caching, preemption by recompute,
speculative decoding and ``n > 1``. Only requests that ask get logits at their prompt rows, in
blocks of at most 256 rows.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from layerzoo import LLM, SamplingParams  # noqa: E402
from layerzoo.errors import UserError  # noqa: E402

TOL = 1e-4


def prompts_of(lengths, seed=0, vocab=64):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def reference(tiny_qwen3_dir):
    """``log_softmax`` of a plain transformers fp32 forward over a whole prompt: ``[P, vocab]``."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_qwen3_dir, torch_dtype=torch.float32).eval()
    cache = {}

    def logprobs(ids):
        key = tuple(ids)
        if key not in cache:
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].float()
            cache[key] = torch.log_softmax(logits, dim=-1)
        return cache[key]

    return logprobs


def check_entries(entries, ids, ref, k):
    """``entries`` is vLLM's prompt_logprobs for prompt ``ids`` with top-``k``, against ``ref(ids)``."""
    assert entries is not None and len(entries) == len(ids)
    assert entries[0] is None
    want = ref(ids)
    for i in range(1, len(ids)):
        entry, row = entries[i], want[i - 1]
        assert isinstance(entry, dict), (i, entry)
        assert ids[i] in entry
        assert entry[ids[i]] == pytest.approx(row[ids[i]].item(), abs=TOL), i
        top_values, top_ids = torch.topk(row, k)
        others = {t: lp for t, lp in entry.items() if t != ids[i]}
        # the top k and the actual token: k entries when it is among them, else k + 1
        assert len(entry) == k + (ids[i] not in top_ids.tolist()), (i, entry)
        assert set(top_ids.tolist()) - {ids[i]} == set(others), (i, entry, top_ids)
        for t, v in zip(top_ids.tolist(), top_values.tolist()):
            assert entry[t] == pytest.approx(v, abs=TOL)


def test_validation():
    for bad in (-1, 1.5, True, "2", 21):
        with pytest.raises(UserError, match="prompt_logprobs"):
            SamplingParams(prompt_logprobs=bad)
    params = SamplingParams()
    assert params.prompt_logprobs is None
    with pytest.raises(UserError, match="prompt_logprobs"):
        params.prompt_logprobs = -2
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20


@pytest.mark.parametrize("k", [0, 3])
def test_chunked_prefill_several_requests_match_transformers(tiny_qwen3_dir, reference, k):
    """Prompts longer than the step budget (16 tokens: chunked prefill splits each), several
    requests in one call, one without prompt logprobs (None), raw logits despite penalties."""
    llm = LLM(tiny_qwen3_dir, dtype="float32", max_num_batched_tokens=16, max_model_len=128, max_num_seqs=4)
    prompts = prompts_of([40, 23, 57, 2, 1])
    asked = SamplingParams(prompt_logprobs=k, max_tokens=2, temperature=0.7, repetition_penalty=1.3, seed=1)
    plain = SamplingParams(max_tokens=2)
    params = [asked, asked, plain, asked, asked]
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for ids, p, r in zip(prompts, params, out):
        if p.prompt_logprobs is None:
            assert r.prompt_logprobs is None
        else:
            check_entries(r.prompt_logprobs, ids, reference, k)
        assert len(r.outputs[0].token_ids) == 2


def test_prefix_cached_prompt_still_scores_every_position(tiny_qwen3_dir, reference):
    llm = LLM(tiny_qwen3_dir, dtype="float32", max_num_batched_tokens=32, max_model_len=128, enable_prefix_caching=True)
    base, tail = prompts_of([48, 9], seed=3)
    first = llm.generate({"prompt_token_ids": base}, SamplingParams(max_tokens=1))[0]
    assert first.prompt_logprobs is None
    hits = llm.stats.prefix_cache_hits
    ids = base + tail
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(prompt_logprobs=2, max_tokens=1))[0]
    check_entries(out.prompt_logprobs, ids, reference, 2)
    # a request without prompt logprobs still reuses the cached prefix
    llm.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=1))
    assert llm.stats.prefix_cache_hits > hits


def test_preemption_by_recompute_neither_duplicates_nor_loses_entries(tiny_qwen3_dir, reference):
    """A KV cache of 12 blocks of 16 tokens: decoding sequences preempt ones still prefilling."""
    per_block = 2 * 2 * 2 * 8 * 4 * 16  # layers, K and V, KV heads, head dim, fp32, block size
    llm = LLM(tiny_qwen3_dir, dtype="float32", max_num_batched_tokens=16, max_model_len=128, max_num_seqs=4,
              kv_cache_memory=12 * per_block, enable_prefix_caching=False)
    prompts = prompts_of([5, 70, 6, 90], seed=5)
    params = SamplingParams(prompt_logprobs=1, max_tokens=40, min_tokens=40, ignore_eos=True, temperature=0)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert llm.stats.preemptions > 0
    assert sum(r.metrics["preemptions"] for r in out[1::2]) > 0  # the long prompts were preempted
    for ids, r in zip(prompts, out):
        check_entries(r.prompt_logprobs, ids, reference, 1)
    # and the tokens are what an unconstrained cache generates
    roomy = LLM(tiny_qwen3_dir, dtype="float32", max_num_batched_tokens=16, max_model_len=128, max_num_seqs=4)
    want = roomy.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [r.outputs[0].token_ids for r in out] == [r.outputs[0].token_ids for r in want]


def test_speculative_decoding_and_n_keep_working(tiny_qwen3_dir, reference):
    prompts = [[5, 6, 7, 8] * 6, [9, 3, 9, 3, 9, 3, 9, 3, 9] * 2]
    greedy = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0)
    plain = LLM(tiny_qwen3_dir, dtype="float32", max_num_batched_tokens=16, max_model_len=96)
    want = [r.outputs[0].token_ids for r in plain.generate([{"prompt_token_ids": p} for p in prompts], greedy)]
    spec = LLM(tiny_qwen3_dir, dtype="float32", max_num_batched_tokens=16, max_model_len=96,
               speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "adaptive": False})
    asked = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0, prompt_logprobs=2)
    out = spec.generate([{"prompt_token_ids": p} for p in prompts], [asked, greedy])
    assert [r.outputs[0].token_ids for r in out] == want
    check_entries(out[0].prompt_logprobs, prompts[0], reference, 2)
    assert out[1].prompt_logprobs is None
    assert spec.stats.spec_verify_steps > 0

    # n > 1: one list per request, whichever completion carries the prompt
    n = SamplingParams(n=3, max_tokens=4, seed=7, prompt_logprobs=0)
    (r,) = plain.generate({"prompt_token_ids": prompts[1]}, n)
    assert len(r.outputs) == 3
    check_entries(r.prompt_logprobs, prompts[1], reference, 0)


def test_only_requests_that_ask_compute_prompt_rows_in_bounded_blocks(tiny_qwen3_dir, reference):
    llm = LLM(tiny_qwen3_dir, dtype="float32", max_num_batched_tokens=640, max_model_len=1024)
    model = llm.engine.runner.model
    rows = []
    original = model.compute_logits

    def counting(hidden):
        rows.append(hidden.shape[0])
        return original(hidden)

    model.compute_logits = counting
    prompts = prompts_of([600, 30], seed=9)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=2))
    assert max(rows) <= 2  # the sampled rows only
    rows.clear()
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], [SamplingParams(max_tokens=2, prompt_logprobs=1),
                                                                    SamplingParams(max_tokens=2)])
    check_entries(out[0].prompt_logprobs, prompts[0], reference, 1)
    assert out[1].prompt_logprobs is None
    assert max(rows) <= 256
    assert sum(rows) == 599 + 2 + 2  # every scored prompt row once, and the sampled rows


def test_tensor_parallel_workers_take_the_same_logits(tiny_qwen3_dir, reference):
    """Two ranks (gloo): the gathered logits are a collective, so the workers compute the prompt
    rows' logits too (the plan's `ChunkRows.prompt_rows`); rank 0 gets the single process's entries."""
    prompts = prompts_of([45, 20], seed=11)
    params = [SamplingParams(prompt_logprobs=2, max_tokens=3, temperature=0), SamplingParams(max_tokens=3, temperature=0)]
    with LLM(tiny_qwen3_dir, tensor_parallel_size=2, dtype="float32", max_num_batched_tokens=16, max_model_len=128) as tp:
        out = tp.generate([{"prompt_token_ids": p} for p in prompts], params)
    check_entries(out[0].prompt_logprobs, prompts[0], reference, 2)
    assert out[1].prompt_logprobs is None
