"""Kimi Linear against transformers: fp32 logits and greedy continuations."""

import random

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.model_loading import load_model
from layerzoo.testing import prefill_logits


def hf_greedy(model, prompt, steps):
    """transformers' greedy continuation, recomputing the whole sequence each step."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(ids, use_cache=False).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("length,chunks", [(1, [1]), (9, [9]), (70, [33, 1, 36]), (150, [64, 50, 36])])
def test_logits_match_transformers(kimi_tiny, length, chunks):
    path, hf_model = kimi_tiny
    model = load_model(path).model
    ids = torch.randint(0, hf_model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(model, ids, chunks), expected, atol=2e-4, rtol=0)


PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def prompts_of(vocab, lengths, seed=7):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def generate(llm, prompts, params=PARAMS):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_greedy_matches_transformers_batched_and_chunked(kimi_tiny):
    path, hf_model = kimi_tiny
    prompts = prompts_of(hf_model.config.vocab_size, (150, 3, 71, 12, 100))
    # A budget of 40 tokens spreads the long prompts over chunks whose ends are not multiples of 64.
    llm = LLM(path, dtype="float32", max_num_batched_tokens=40, enable_prefix_caching=False)
    for prompt, out in zip(prompts, generate(llm, prompts)):
        assert out == hf_greedy(hf_model, prompt, PARAMS.max_tokens)


def test_greedy_with_prefix_hits_and_speculation(kimi_tiny):
    """Prompts sharing a long prefix resume from cached latents and KDA snapshots; the n-gram
    proposer's drafts are verified over the latent cache and dropped from the KDA state."""
    path, hf_model = kimi_tiny
    vocab = hf_model.config.vocab_size
    shared = prompts_of(vocab, (70,), seed=3)[0]
    # Repetitive tails give the n-gram proposer drafts to verify.
    prompts = [shared + [5, 6, 7, 5, 6, 7, 5, 6], shared + [9, 9, 9, 9], shared[:40] + [1, 2, 1, 2, 1, 2]]
    expected = [hf_greedy(hf_model, p, PARAMS.max_tokens) for p in prompts]
    llm = LLM(path, dtype="float32", block_size=16, ssm_snapshot_interval=1,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    assert generate(llm, prompts[:1]) == expected[:1]
    assert generate(llm, prompts[1:]) == expected[1:]
    stats = llm.engine.stats
    assert stats.prefix_cache_hits > 0 and stats.state_snapshot_hits > 0
    assert stats.spec_verify_steps > 0
