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
