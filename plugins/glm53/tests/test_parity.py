"""GLM-5 (MLA + DSA + MoE) against transformers: fp32 logits and greedy continuations, with prompts
longer than ``index_topk`` so the indexer's selection decides the outputs."""

import random

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.loading.model_loading import load_model
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


def test_indexer_scores_have_no_ties_at_the_cut(glm_tiny):
    """The premise of exact greedy parity: wherever a row has more visible keys than index_topk,
    its k-th and (k+1)-th index scores are clearly apart (no exact ReLU-zero ties, no near-ties
    that fp32 summation order could flip), so transformers' and our top-k pick the same set."""
    from layerzoo_glm53.ops.dsa_indexer_topk.reference import dsa_indexer_scores

    path, hf_model = glm_tiny
    model = load_model(path).model
    k = hf_model.config.index_topk
    gaps = []

    def recording(q, weights, keys, q_positions, top_k, scale):
        scores = dsa_indexer_scores(q, weights, keys, q_positions, scale)
        ranked = scores.sort(dim=-1, descending=True).values
        wide = (q_positions + 1) > k  # rows that really choose
        gaps.append((ranked[..., k - 1] - ranked[..., k])[wide])
        return scores.topk(top_k, dim=-1).indices

    for layer in model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer._topk = recording
    ids = torch.randint(0, hf_model.config.vocab_size, (50,), generator=torch.Generator().manual_seed(50))
    prefill_logits(model, ids, [50], block_size=8)
    gaps = torch.cat(gaps)
    assert gaps.numel() == 3 * (50 - k) and gaps.min() > 1e-4


def random_config(seed, helpers):
    """A random GLM-5 shape: layers, IndexShare pattern, index_topk, indexer heads and dims, MLA
    dims, grouped routing and dense first layers all drawn."""
    rng = random.Random(seed)
    layers = rng.randrange(2, 5)
    indexer_types = ["full"] + [rng.choice(["full", "shared"]) for _ in range(layers - 1)]
    groups = rng.choice([1, 2])
    experts = groups * rng.choice([2, 3])
    rope = rng.choice([4, 8])
    heads = rng.choice([2, 4])
    return helpers.glm_config(
        vocab_size=rng.randrange(90, 160), hidden_size=rng.choice([24, 32]), num_hidden_layers=layers,
        intermediate_size=rng.randrange(16, 48), moe_intermediate_size=rng.randrange(8, 24),
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=rng.choice([8, 12]),
        kv_lora_rank=rng.choice([8, 16]), qk_nope_head_dim=rng.choice([8, 16]), qk_rope_head_dim=rope,
        v_head_dim=rng.choice([8, 12]), n_routed_experts=experts, num_experts_per_tok=rng.randrange(1, experts // groups + 1),
        n_group=groups, topk_group=1 if groups == 1 else rng.choice([1, 2]), routed_scaling_factor=rng.choice([1.0, 2.5]),
        first_k_dense_replace=rng.randrange(0, 3), index_topk=rng.choice([3, 5, 11]), index_head_dim=rng.choice([rope, 12, 16]),
        index_n_heads=rng.choice([8, 12]), indexer_types=indexer_types,
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_random_shapes_match_transformers(seed, glm_helpers, tmp_path):
    config = random_config(seed, glm_helpers)
    hf_model = glm_helpers.save_tiny(tmp_path, config, seed=seed)
    prompts = prompts_of(config.vocab_size, (37, 6, 20), seed=seed)
    llm = LLM(tmp_path, dtype="float32", max_num_batched_tokens=13, block_size=4)
    for prompt, out in zip(prompts, generate(llm, prompts)):
        assert out == glm_helpers.hf_greedy(hf_model, prompt, PARAMS.max_tokens)


def test_greedy_with_speculation(glm_tiny, glm_helpers):
    """n-gram drafts are verified over the latent and indexer-key rows (several rows of one
    sequence past index_topk in one step) and rejected ones are rewound by the KV cursor."""
    path, hf_model = glm_tiny
    base = prompts_of(hf_model.config.vocab_size, (20,), seed=5)[0]
    prompts = [base + [5, 6, 7, 5, 6, 7, 5, 6], base[:12] + [9, 9, 9, 9, 9, 9]]
    llm = LLM(path, dtype="float32", block_size=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "adaptive": False})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert generate(llm, prompts, params) == [glm_helpers.hf_greedy(hf_model, p, 12) for p in prompts]
    assert llm.engine.stats.spec_verify_steps > 0
