"""Qwen3-Next and Qwen3.5 against transformers: fp32 logits and greedy continuations."""

import random

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.model import load_model
from layerzoo.testing import prefill_logits


def hf_greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    return out[0, len(prompt) :].tolist()


@pytest.fixture(params=["qwen3_next", "qwen3_5"])
def tiny(request):
    return request.getfixturevalue(f"{request.param}_tiny")


@pytest.mark.parametrize("length,chunks", [(1, [1]), (9, [9]), (70, [33, 1, 36]), (150, [64, 50, 36])])
def test_logits_match_transformers(tiny, length, chunks):
    path, hf_model = tiny
    model = load_model(path).model
    vocab = hf_model.config.vocab_size
    ids = torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(model, ids, chunks), expected, atol=2e-4, rtol=0)


def test_greedy_matches_transformers_batched_and_chunked(tiny):
    path, hf_model = tiny
    vocab = hf_model.config.vocab_size
    rng = random.Random(7)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (150, 3, 71, 12, 100)]
    # A budget of 40 tokens spreads the long prompts over chunks whose ends are not multiples of 64.
    llm = LLM(path, dtype="float32", max_num_batched_tokens=40, enable_prefix_caching=False)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 12)
