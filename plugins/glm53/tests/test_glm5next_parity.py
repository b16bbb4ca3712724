"""GLM-5.3-Flash (KDA + k-pool DSA + mHC + clamped MoE) against transformers' Glm5Next: fp32 logits
and greedy continuations, with prompts far longer than ``index_topk`` (two pools of 4) so the
indexer's pool selection decides the outputs."""

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


def vocab(hf_model):
    return hf_model.config.text_config.vocab_size


@pytest.mark.parametrize("length,chunks", [(3, [3]), (9, [9]), (40, [40]), (45, [13, 1, 2, 29])])
def test_logits_match_transformers(next_tiny, length, chunks):
    path, hf_model = next_tiny
    model = load_model(path).model
    ids = torch.randint(0, vocab(hf_model), (length,), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(model, ids, chunks, block_size=8), expected, atol=2e-4, rtol=0)


def test_sparse_pool_selection_matters(next_tiny):
    """The same weights with index_topk >= the prompt (every complete pool) give other logits."""
    path, hf_model = next_tiny
    ids = torch.randint(0, vocab(hf_model), (40,), generator=torch.Generator().manual_seed(1))
    sparse = prefill_logits(load_model(path).model, ids, [40], block_size=8)
    dense_model = load_model(path).model
    for layer in dense_model.layers:
        indexer = getattr(layer.self_attn, "indexer", None)
        if indexer is not None:
            indexer.index_topk = 64
    dense = prefill_logits(dense_model, ids, [40], block_size=8)
    assert (sparse[-1] - dense[-1]).abs().max() > 1e-2


def test_pool_scores_have_no_ties_at_the_cut(next_tiny):
    """The premise of exact greedy parity: wherever a row sees more complete pools than it keeps,
    its kept and first dropped pool scores are clearly apart (no ReLU-zero ties, no near-ties
    fp32 summation order could flip), so transformers and we keep the same pools."""
    from layerzoo_glm53.ops.dsa_indexer_topk.reference import dsa_indexer_scores

    path, hf_model = next_tiny
    model = load_model(path).model
    top = hf_model.config.text_config.index_topk // hf_model.config.text_config.index_kpool
    gaps = []

    def recording(q, weights, keys, last_pool, top_k, scale):
        scores = dsa_indexer_scores(q, weights, keys, last_pool, scale)
        ranked = scores.sort(dim=-1, descending=True).values
        choosing = (last_pool + 1) > top
        gaps.append((ranked[..., top - 1] - ranked[..., top])[choosing])
        return scores.topk(top_k, dim=-1).indices

    indexers = [layer.self_attn.indexer for layer in model.layers if getattr(layer.self_attn, "indexer", None) is not None]
    for indexer in indexers:
        indexer._topk = recording
    ids = torch.randint(0, vocab(hf_model), (50,), generator=torch.Generator().manual_seed(50))
    prefill_logits(model, ids, [50], block_size=8)
    gaps = torch.cat(gaps)
    # rows at positions p with (p + 1) // 4 > top, in each full indexer layer
    assert gaps.numel() == len(indexers) * (50 - (top + 1) * 4 + 1) and gaps.min() > 1e-4


def test_greedy_matches_transformers_batched_and_chunked(next_tiny, next_helpers):
    path, hf_model = next_tiny
    prompts = prompts_of(vocab(hf_model), (50, 3, 31, 13))
    # 19 tokens a step: the long prompts' chunks end inside pools and blocks
    llm = LLM(path, dtype="float32", max_num_batched_tokens=19, block_size=8, enable_prefix_caching=False)
    for prompt, out in zip(prompts, generate(llm, prompts)):
        assert out == next_helpers.hf_greedy(hf_model, prompt, PARAMS.max_tokens)


def test_greedy_with_prefix_hits(next_tiny, next_helpers):
    """Prompts sharing a prefix longer than index_topk resume from cached latents, per-token
    indexer rows, pooled rows and KDA state snapshots."""
    path, hf_model = next_tiny
    shared = prompts_of(vocab(hf_model), (33,), seed=3)[0]
    prompts = [shared + [5, 6, 7], shared + [9, 9], shared[:21] + [1, 2, 1]]
    expected = [next_helpers.hf_greedy(hf_model, p, PARAMS.max_tokens) for p in prompts]
    llm = LLM(path, dtype="float32", block_size=8)
    assert generate(llm, prompts[:1]) == expected[:1]
    assert generate(llm, prompts[1:]) == expected[1:]
    assert llm.engine.stats.prefix_cache_hits > 0


def test_greedy_with_speculation(next_tiny, next_helpers):
    """n-gram drafts verified over the latent, indexer and pooled rows and the KDA state; rejected
    drafts rewound (the pooled row of a pool they touched is recomputed when it is rewritten)."""
    path, hf_model = next_tiny
    base = prompts_of(vocab(hf_model), (21,), seed=5)[0]
    prompts = [base + [5, 6, 7, 5, 6, 7, 5, 6], base[:13] + [9, 9, 9, 9, 9, 9]]
    llm = LLM(path, dtype="float32", block_size=8,
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "adaptive": False})
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    assert generate(llm, prompts, params) == [next_helpers.hf_greedy(hf_model, p, 12) for p in prompts]
    assert llm.engine.stats.spec_verify_steps > 0


def random_text_config(seed, helpers):
    """A random GLM-5.3-Flash shape: layer pattern, IndexShare, pool size, index_topk, indexer
    heads, MLA and KDA dims, streams, grouped routing and dense first layers all drawn."""
    rng = random.Random(seed)
    layers = rng.randrange(2, 6)
    types = [rng.choice(["linear_attention", "indexed_attention"]) for _ in range(layers)]
    types[rng.randrange(layers)] = "indexed_attention"
    indexer = ["full"] * layers
    for i in range(1, layers):
        if types[i] == types[i - 1] == "indexed_attention" and indexer[i - 1] == "full" and rng.random() < 0.5:
            indexer[i] = "shared"
    kpool = rng.choice([1, 2, 4])
    groups = rng.choice([1, 2])
    experts = groups * rng.choice([2, 3])
    heads = rng.choice([1, 2, 4])
    dense = rng.randrange(0, layers + 1)
    return helpers.text_config(
        vocab_size=rng.randrange(90, 160), hidden_size=rng.choice([16, 24]), num_hidden_layers=layers,
        layer_types=types, indexer_types=indexer, mlp_layer_types=["dense"] * dense + ["sparse"] * (layers - dense),
        intermediate_size=rng.randrange(16, 40), moe_intermediate_size=rng.randrange(8, 20),
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=rng.choice([8, 12]),
        kv_lora_rank=rng.choice([8, 16]), qk_nope_head_dim=rng.choice([8, 12]), v_head_dim=rng.choice([8, 12]),
        n_routed_experts=experts, num_experts_per_tok=rng.randrange(1, experts // groups + 1), n_group=groups,
        topk_group=1 if groups == 1 else rng.choice([1, 2]), index_kpool=kpool, index_topk=kpool * rng.choice([2, 3]),
        index_head_dim=rng.choice([12, 16]), index_n_heads=rng.choice([8, 12]),
        linear_num_heads=rng.choice([1, 2]), linear_head_dim=rng.choice([8, 16]), hc_mult=rng.choice([1, 2, 4]),
        swiglu_limit=rng.choice([1.0, 10.0]),
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_random_shapes_match_transformers(seed, next_helpers, tmp_path):
    config = random_text_config(seed, next_helpers)
    hf_model = next_helpers.save_tiny(tmp_path, config, seed=seed)
    prompts = prompts_of(config["vocab_size"], (37, 6, 20), seed=seed)
    llm = LLM(tmp_path, dtype="float32", max_num_batched_tokens=13, block_size=4)
    for prompt, out in zip(prompts, generate(llm, prompts)):
        assert out == next_helpers.hf_greedy(hf_model, prompt, PARAMS.max_tokens)
