import os
import types

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from layerzoo.testing import write_word_tokenizer  # noqa: E402

INIT_RANGE = 0.25  # large enough that greedy steps are not near-ties


def save_tiny(path, config, *, seed: int = 0):
    """Build a random transformers Llama/Mistral from ``config`` and save it with a tokenizer."""
    torch.manual_seed(seed)
    config.initializer_range = INIT_RANGE
    config._attn_implementation = "eager"
    cls = transformers.MistralForCausalLM if config.model_type == "mistral" else transformers.LlamaForCausalLM
    model = cls(config).eval()
    model.save_pretrained(path)
    write_word_tokenizer(path, config.vocab_size)
    return model


COMMON = dict(
    vocab_size=127, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


def llama_config(**overrides):
    return transformers.LlamaConfig(**{**COMMON, **overrides})


def mistral_config(**overrides):
    return transformers.MistralConfig(**{**COMMON, "sliding_window": None, **overrides})


CONFIGS = {
    "llama": lambda: llama_config(),
    "llama-bias-tied": lambda: llama_config(attention_bias=True, tie_word_embeddings=True, num_key_value_heads=4),
    "llama3-rope": lambda: llama_config(
        head_dim=16,  # != hidden / heads
        rope_parameters={
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
        },
    ),
    "mistral": lambda: mistral_config(num_key_value_heads=1),
}


@pytest.fixture(scope="session")
def llama_tiny():
    return types.SimpleNamespace(save_tiny=save_tiny, llama_config=llama_config, mistral_config=mistral_config)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name -> (checkpoint dir, transformers model) for every config in CONFIGS."""
    root = tmp_path_factory.mktemp("llama-models")
    return {name: (root / name, save_tiny(root / name, make(), seed=i)) for i, (name, make) in enumerate(CONFIGS.items())}
