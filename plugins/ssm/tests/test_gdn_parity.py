"""Qwen3-Next and Qwen3.5 against transformers: fp32 logits and greedy continuations."""

import random

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.loading.model_loading import load_model
from layerzoo.testing import prefill_logits


def hf_greedy(model, prompt, steps):
    """transformers' greedy continuation, recomputing the whole sequence each step (no cache:
    its cache cannot serve a model without any attention layer)."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(ids, use_cache=False).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


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
    # Logits reach ~7 here. One row of the 150-token Qwen3-Next prompt (125) amplifies rounding-order
    # differences a thousandfold: 1e-4 from transformers with torch's own ops on an AVX-512 CPU,
    # 3e-4 chunked, 7.5e-4 with the C++ RMSNorm (its sums in 16 lanes; 1e-7 apart per norm). A
    # wrong formula moves logits by 1e-1 or more, and the greedy tests below compare tokens.
    torch.testing.assert_close(prefill_logits(model, ids, chunks), expected, atol=1e-3, rtol=0)


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


def random_config(seed, ssm_tiny):
    """A random Qwen3-Next or Qwen3.5 shape, for parity beyond the hand-picked configs."""
    rng = random.Random(seed)
    k_heads = rng.choice([1, 2])
    heads = rng.choice([1, 2, 4])
    common = dict(
        vocab_size=rng.randrange(90, 200), hidden_size=rng.choice([24, 32, 48]), num_hidden_layers=rng.randrange(2, 6),
        num_attention_heads=heads, num_key_value_heads=rng.choice([h for h in (1, 2, 4) if heads % h == 0]),
        head_dim=rng.choice([8, 16]), intermediate_size=rng.randrange(16, 64),
        linear_num_key_heads=k_heads, linear_num_value_heads=k_heads * rng.choice([1, 2, 3]),
        linear_key_head_dim=rng.choice([4, 8, 12]), linear_value_head_dim=rng.choice([4, 8, 12]),
        linear_conv_kernel_dim=rng.choice([2, 3, 4]), full_attention_interval=rng.choice([2, 3]),
        tie_word_embeddings=rng.random() < 0.5, rms_norm_eps=rng.choice([1e-6, 1e-5]),
    )
    if rng.random() < 0.5:
        experts = rng.randrange(2, 6)
        config = ssm_tiny.next_config(
            **common, num_experts=experts, num_experts_per_tok=rng.randrange(1, experts + 1),
            moe_intermediate_size=rng.randrange(8, 24), shared_expert_intermediate_size=rng.randrange(8, 24),
            norm_topk_prob=rng.random() < 0.5, decoder_sparse_step=rng.choice([1, 2]), mlp_only_layers=[],
        )
        return transformers.Qwen3NextForCausalLM, config
    del common["full_attention_interval"]
    layers = common["num_hidden_layers"]
    common["layer_types"] = ["full_attention" if rng.random() < 0.3 else "linear_attention" for _ in range(layers)]
    return transformers.Qwen3_5ForCausalLM, ssm_tiny.qwen3_5_text_config(**common)


transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("seed", range(3))
def test_random_shapes_match_transformers(tmp_path, seed, ssm_tiny):
    model_cls, config = random_config(seed, ssm_tiny)
    hf_model = ssm_tiny.save_tiny(tmp_path, model_cls, config, seed=seed)
    prompts = [list(range(1, 80)), [5, 4, 3]]
    outs = LLM(tmp_path, dtype="float32", max_num_batched_tokens=30).generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )
    for prompt, out in zip(prompts, outs):
        assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt, 10)


def test_unfused_projections_give_the_same_logits(tiny, monkeypatch):
    """With CPU weight packing off the GDN projections stay separate matmuls: same logits, up to
    the rounding of oneDNN vs. plain matmuls, which this tiny random model amplifies to ~3e-4."""
    path, _ = tiny
    ids = torch.arange(3, 70)
    fused = prefill_logits(load_model(path).model, ids, [40, 27])
    monkeypatch.setenv("LAYERZOO_CPU_PACKED_LINEAR", "0")
    model = load_model(path).model
    assert model.layers[0].linear_attn.in_proj is None
    torch.testing.assert_close(prefill_logits(model, ids, [40, 27]), fused, atol=1e-3, rtol=0)
