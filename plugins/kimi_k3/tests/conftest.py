import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from layerzoo.testing import write_word_tokenizer  # noqa: E402

# Large enough that greedy steps are not near-ties between two tokens.
INIT_RANGE = 0.25


def kimi_config(**overrides):
    """A tiny Kimi Linear config: KDA layers 1, 2, 4 and MLA at 3 (1-indexed), MoE from layer 1."""
    base = dict(
        vocab_size=131, hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        num_experts=6, num_experts_per_token=2, num_shared_experts=1, routed_scaling_factor=2.446,
        linear_attn_config={"head_dim": 16, "num_heads": 2, "short_conv_kernel_size": 4,
                            "kda_layers": [1, 2, 4], "full_attn_layers": [3]},
        first_k_dense_replace=1, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    base.update(overrides)
    return transformers.KimiLinearConfig(**base)


def save_tiny(path, config, *, seed: int = 0):
    """Build a random transformers Kimi Linear, perturb its norms, gates and router bias, save it."""
    torch.manual_seed(seed)
    config.initializer_range = INIT_RANGE
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    model = transformers.KimiLinearForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "A_log", "dt_bias")):
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(path)
    write_word_tokenizer(path, config.vocab_size)
    return model


@pytest.fixture(scope="session")
def kimi_tiny_helpers():
    """The helpers above, for test modules (conftest is not importable under importlib mode)."""
    import types

    return types.SimpleNamespace(save_tiny=save_tiny, kimi_config=kimi_config)


@pytest.fixture(scope="session")
def kimi_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("kimi-linear")
    return path, save_tiny(path, kimi_config())
