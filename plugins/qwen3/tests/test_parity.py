"""Qwen3 and Qwen3-MoE against transformers: fp32 logits and greedy continuations."""

import random

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.loading.model_loading import load_model
from layerzoo.testing import prefill_logits

NAMES = ["dense", "dense-tied", "dense-yarn", "moe", "moe-sparse-step", "dense-sharded"]


def hf_greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(ids).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("length,chunks", [(1, [1]), (7, [7]), (40, [16, 16, 8]), (97, [50, 47])])
def test_logits_match_transformers(tiny_models, name, length, chunks):
    path, hf_model = tiny_models[name]
    model = load_model(path).model
    ids = torch.randint(0, hf_model.config.vocab_size, (length,), generator=torch.Generator().manual_seed(length))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(model, ids, chunks), expected, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", NAMES)
def test_greedy_matches_transformers_batched(tiny_models, name):
    path, hf_model = tiny_models[name]
    vocab = hf_model.config.vocab_size
    rng = random.Random(name)
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 11, 30, 5)]
    llm = LLM(path, dtype="float32")
    outs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    )
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 32)
        assert out.outputs[0].finish_reason == "length"


def random_config(seed, dense_config, moe_config):
    """A random Qwen3 or Qwen3-MoE shape, for parity beyond the hand-picked configs."""
    rng = random.Random(seed)
    kv = rng.choice([1, 2, 3])
    heads = kv * rng.choice([1, 2, 3])
    common = dict(
        vocab_size=rng.randrange(50, 300), hidden_size=rng.choice([24, 36, 64]), num_hidden_layers=rng.randrange(1, 5),
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=rng.choice([8, 12, 20]),
        intermediate_size=rng.randrange(16, 96), tie_word_embeddings=rng.random() < 0.5,
        rope_theta=rng.choice([1e4, 1e6]), rms_norm_eps=rng.choice([1e-6, 1e-5]),
    )
    if rng.random() < 0.5:
        return dense_config(**common)
    experts = rng.randrange(2, 9)
    return moe_config(
        **common, num_experts=experts, num_experts_per_tok=rng.randrange(1, experts + 1),
        moe_intermediate_size=rng.randrange(8, 40), norm_topk_prob=rng.random() < 0.5,
        decoder_sparse_step=rng.choice([1, 2]), mlp_only_layers=[0] if rng.random() < 0.5 else [],
    )


@pytest.mark.parametrize("seed", range(4))
def test_random_shapes_match_transformers(tmp_path, seed, qwen3_tiny):
    config = random_config(seed, qwen3_tiny.dense_config, qwen3_tiny.moe_config)
    hf_model = qwen3_tiny.save_tiny(tmp_path, config, seed=seed)
    prompt = list(range(1, 20))
    out = LLM(tmp_path, dtype="float32").generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )
    assert out[0].outputs[0].token_ids == hf_greedy(hf_model, prompt, 16)


def test_tied_embeddings_share_storage(tiny_models):
    model = load_model(tiny_models["dense-tied"][0]).model
    assert model.lm_head.weight is model.model.embed_tokens.weight


def test_moe_layers_follow_sparse_step_and_mlp_only(tiny_models):
    from layerzoo.layers.moe import SparseMoE

    model = load_model(tiny_models["moe"][0]).model
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.layers] == [True, True, False, True]
    model = load_model(tiny_models["moe-sparse-step"][0]).model
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.layers] == [False, True, False, True]
