"""GLM-5 (MLA + DSA + MoE) against transformers: fp32 logits and greedy continuations, with prompts
longer than ``index_topk`` so the indexer's selection decides the outputs."""

import random

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.model_loading import load_model
from layerzoo.testing import prefill_logits

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompts_of(vocab, lengths, seed=7):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def generate(llm, prompts, params=PARAMS):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.mark.parametrize("length,chunks", [(5, [5]), (40, [40]), (45, [17, 1, 27])])
def test_logits_match_transformers(glm_tiny, length, chunks):
    path, hf_model = glm_tiny
    model = load_model(path).model
    ids = torch.randint(0, hf_model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(model, ids, chunks, block_size=8), expected, atol=2e-4, rtol=0)


def test_sparse_selection_matters(glm_tiny, glm_helpers, tmp_path):
    """The same weights with index_topk >= the prompt (dense attention) give other logits: the
    parity above is a test of the selection, not of plain MLA."""
    path, hf_model = glm_tiny
    ids = torch.randint(0, hf_model.config.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    sparse = prefill_logits(load_model(path).model, ids, [40], block_size=8)
    dense_model = load_model(path).model
    for layer in dense_model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.index_topk = 64
    dense = prefill_logits(dense_model, ids, [40], block_size=8)
    assert (sparse[-1] - dense[-1]).abs().max() > 1e-2


def test_greedy_matches_transformers_batched_and_chunked(glm_tiny, glm_helpers):
    path, hf_model = glm_tiny
    prompts = prompts_of(hf_model.config.vocab_size, (50, 3, 31, 12))
    # A budget of 19 tokens spreads the long prompts over chunks whose ends are not block-aligned.
    llm = LLM(path, dtype="float32", max_num_batched_tokens=19, block_size=8, enable_prefix_caching=False)
    for prompt, out in zip(prompts, generate(llm, prompts)):
        assert out == glm_helpers.hf_greedy(hf_model, prompt, PARAMS.max_tokens)


def test_greedy_with_prefix_hits(glm_tiny, glm_helpers):
    """Prompts sharing a prefix longer than index_topk resume from cached latents and indexer keys."""
    path, hf_model = glm_tiny
    shared = prompts_of(hf_model.config.vocab_size, (33,), seed=3)[0]
    prompts = [shared + [5, 6, 7], shared + [9, 9], shared[:20] + [1, 2, 1]]
    expected = [glm_helpers.hf_greedy(hf_model, p, PARAMS.max_tokens) for p in prompts]
    llm = LLM(path, dtype="float32", block_size=8)
    assert generate(llm, prompts[:1]) == expected[:1]
    assert generate(llm, prompts[1:]) == expected[1:]
    assert llm.engine.stats.prefix_cache_hits > 0
