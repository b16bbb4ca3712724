import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from layerzoo.testing import write_word_tokenizer  # noqa: E402

# Large enough that greedy steps are not near-ties between two tokens.
INIT_RANGE = 0.25


def save_tiny(path, model_cls, config, *, seed: int = 0):
    """Build a random transformers model, perturb its zero-initialised norms and gates, save it."""
    torch.manual_seed(seed)
    config.initializer_range = INIT_RANGE
    config._attn_implementation = "eager"
    if getattr(config, "num_experts", 0):
        config._experts_implementation = "eager"
    model = model_cls(config).eval()
    with torch.no_grad():
        # (1 + w) norms start at w = 0 and A_log/dt_bias at fixed values: randomise them so that a
        # wrong formula cannot hide behind an identity.
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(path)
    vocab = config.get_text_config().vocab_size
    write_word_tokenizer(path, vocab)
    return model


def next_config(**overrides):
    base = dict(
        vocab_size=151, hidden_size=48, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12,
        linear_conv_kernel_dim=4, full_attention_interval=2,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24, shared_expert_intermediate_size=20,
        decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True,
        max_position_embeddings=1024, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    base.update(overrides)
    return transformers.Qwen3NextConfig(**base)


def qwen3_5_text_config(**overrides):
    base = dict(
        vocab_size=139, hidden_size=40, intermediate_size=56, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        max_position_embeddings=1024, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    base.update(overrides)
    return transformers.Qwen3_5TextConfig(**base)


@pytest.fixture(scope="session")
def ssm_tiny():
    """The helpers above, for test modules (conftest is not importable under importlib mode)."""
    import types

    return types.SimpleNamespace(save_tiny=save_tiny, next_config=next_config, qwen3_5_text_config=qwen3_5_text_config)


@pytest.fixture(scope="session")
def qwen3_next_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-next")
    model = save_tiny(path, transformers.Qwen3NextForCausalLM, next_config())
    return path, model


@pytest.fixture(scope="session")
def qwen3_5_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-5")
    model = save_tiny(path, transformers.Qwen3_5ForCausalLM, qwen3_5_text_config(), seed=1)
    return path, model


@pytest.fixture(scope="session")
def mamba2_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("mamba2")
    config = transformers.Mamba2Config(
        vocab_size=120, hidden_size=48, num_hidden_layers=2, state_size=8, head_dim=12, num_heads=8,
        expand=2, n_groups=2, conv_kernel=4, chunk_size=32, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    model = save_tiny(path, transformers.Mamba2ForCausalLM, config, seed=2)
    return path, model
