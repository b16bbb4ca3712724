import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from layerzoo.testing import write_word_tokenizer  # noqa: E402

# Large enough that greedy steps are not near-ties between two tokens.
INIT_RANGE = 0.25


def save_tiny(path, config, *, seed: int = 0, shard: str | None = None):
    """Build a random transformers model from ``config``, save it (safetensors) with a tokenizer."""
    torch.manual_seed(seed)
    config.initializer_range = INIT_RANGE
    # The plain-torch references: grouped_mm experts reject odd shapes on CPU.
    config._attn_implementation = "eager"
    if config.model_type == "qwen3_moe":
        config._experts_implementation = "eager"
    cls = transformers.Qwen3MoeForCausalLM if config.model_type == "qwen3_moe" else transformers.Qwen3ForCausalLM
    model = cls(config).eval()
    kwargs = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kwargs)
    write_word_tokenizer(path, config.vocab_size)
    return model


def dense_config(**overrides):
    base = dict(
        vocab_size=131, hidden_size=48, intermediate_size=72, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24,  # head_dim != hidden / heads
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    base.update(overrides)
    return transformers.Qwen3Config(**base)


def moe_config(**overrides):
    base = dict(
        vocab_size=113, hidden_size=40, intermediate_size=64, moe_intermediate_size=20,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[2],  # dense layers mixed in
        max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    base.update(overrides)
    return transformers.Qwen3MoeConfig(**base)


CONFIGS = {
    "dense": lambda: dense_config(),
    "dense-tied": lambda: dense_config(tie_word_embeddings=True, num_key_value_heads=4, head_dim=12),
    "dense-yarn": lambda: dense_config(
        rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 64}
    ),
    "moe": lambda: moe_config(),
    "moe-sparse-step": lambda: moe_config(decoder_sparse_step=2, mlp_only_layers=[], norm_topk_prob=False),
}


@pytest.fixture(scope="session")
def qwen3_tiny():
    """The helpers above, for test modules (conftest is not importable under importlib mode)."""
    import types

    return types.SimpleNamespace(save_tiny=save_tiny, dense_config=dense_config, moe_config=moe_config)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory):
    """name -> (checkpoint dir, transformers model) for every config in CONFIGS (+ a sharded save)."""
    root = tmp_path_factory.mktemp("qwen3-models")
    out = {}
    for i, (name, make) in enumerate(CONFIGS.items()):
        out[name] = (root / name, save_tiny(root / name, make(), seed=i))
    out["dense-sharded"] = (root / "dense-sharded", save_tiny(root / "dense-sharded", dense_config(), seed=0, shard="20KB"))
    return out
