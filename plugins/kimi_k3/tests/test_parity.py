"""Kimi Linear against transformers: fp32 logits and greedy continuations."""

import random

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.loading.model_loading import load_model
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
              speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "adaptive": False})
    assert generate(llm, prompts[:1]) == expected[:1]
    assert generate(llm, prompts[1:]) == expected[1:]
    stats = llm.engine.stats
    assert stats.prefix_cache_hits > 0 and stats.state_snapshot_hits > 0
    assert stats.spec_verify_steps > 0


def random_config(seed, helpers):
    """A random Kimi Linear shape: layer layout, q_lora or not, MLA and KDA dims, grouped routing,
    shared experts and dense first layers all drawn."""
    rng = random.Random(seed)
    layers = rng.randrange(2, 6)
    full = sorted(rng.sample(range(1, layers + 1), rng.randrange(1, layers)))
    groups = rng.choice([1, 2])
    experts = groups * rng.choice([2, 3, 4])
    heads = rng.choice([1, 2, 4])
    return helpers.kimi_config(
        vocab_size=rng.randrange(90, 200), hidden_size=rng.choice([24, 32, 48]), num_hidden_layers=layers,
        intermediate_size=rng.randrange(16, 64), moe_intermediate_size=rng.randrange(8, 32),
        num_attention_heads=heads, num_key_value_heads=heads, q_lora_rank=rng.choice([None, 12]), kv_lora_rank=rng.choice([8, 16, 24]),
        qk_nope_head_dim=rng.choice([8, 16]), qk_rope_head_dim=rng.choice([4, 8]), v_head_dim=rng.choice([8, 12]),
        num_experts=experts, num_experts_per_token=rng.randrange(1, experts // groups + 1), num_expert_group=groups,
        topk_group=groups, num_shared_experts=rng.choice([1, 2]), routed_scaling_factor=rng.choice([1.0, 2.5]),
        first_k_dense_replace=rng.randrange(0, 3),
        linear_attn_config={"head_dim": rng.choice([8, 16]), "num_heads": rng.choice([1, 2, 3]), "short_conv_kernel_size": 4,
                            "kda_layers": [i for i in range(1, layers + 1) if i not in full], "full_attn_layers": full},
    )


@pytest.mark.parametrize("seed", [0, 1])
def test_random_shapes_match_transformers(seed, kimi_tiny_helpers, tmp_path):
    config = random_config(seed, kimi_tiny_helpers)
    hf_model = kimi_tiny_helpers.save_tiny(tmp_path, config, seed=seed)
    prompts = prompts_of(config.vocab_size, (90, 7), seed=seed)
    llm = LLM(tmp_path, dtype="float32", max_num_batched_tokens=37, block_size=8)
    for prompt, out in zip(prompts, generate(llm, prompts)):
        assert out == hf_greedy(hf_model, prompt, PARAMS.max_tokens)
