"""Qwen2 (Qwen3 without QK-norm, with q/k/v biases) against transformers: logits and greedy tokens."""

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.loading.model_loading import load_model
from layerzoo.testing import prefill_logits, write_word_tokenizer

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2")
    torch.manual_seed(5)
    config = transformers.Qwen2Config(
        vocab_size=101, hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True, initializer_range=0.25,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    config._attn_implementation = "eager"
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # transformers initialises biases to zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    write_word_tokenizer(path, config.vocab_size)
    return path, model


def test_qwen2_layers_have_qkv_bias_only(qwen2):
    attn = load_model(qwen2[0]).model.layers[0].self_attn
    assert attn.o_proj.bias is None and not attn.qk_norm


@pytest.mark.parametrize("chunks", [[30], [11, 19]])
def test_qwen2_logits_match_transformers(qwen2, chunks):
    path, hf_model = qwen2
    ids = torch.randint(0, 101, (30,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(load_model(path).model, ids, chunks), expected, atol=1e-4, rtol=0)


def test_qwen2_greedy_matches_transformers(qwen2):
    path, hf_model = qwen2
    prompts = [[3, 9, 27, 81], list(range(40, 75))]
    outs = LLM(path, dtype="float32").generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    )
    for prompt, out in zip(prompts, outs):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            for _ in range(16):
                ids = torch.cat([ids, hf_model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
        assert out.outputs[0].token_ids == ids[0, len(prompt):].tolist()
