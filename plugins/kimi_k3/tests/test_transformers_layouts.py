"""Kimi Linear's two config layouts (issue 34): the checkpoint transformers' own ``save_pretrained``
writes (flat ``linear_num_heads``, ``linear_head_dim``, ``linear_conv_kernel_dim``, ``layer_types``)
loads and runs as transformers runs it; the released checkpoints' nested ``linear_attn_config``
wins over its flat twins, as transformers reads them."""

import json
import shutil

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.errors import ConfigError
from layerzoo.loading.model_loading import load_model
from layerzoo.testing import prefill_logits

transformers = pytest.importorskip("transformers")

# transformers' own spelling: no linear_attn_config at all (KDA layers 1, 2, 4 and MLA at 3).
FLAT = dict(
    vocab_size=131, hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
    kv_lora_rank=24, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
    num_experts=6, num_experts_per_token=2, num_shared_experts=1, routed_scaling_factor=2.446,
    linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=3,
    layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
    mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    eos_token_id=None, bos_token_id=None, pad_token_id=None,
)


@pytest.fixture(scope="module")
def flat_tiny(tmp_path_factory, kimi_tiny_helpers):
    path = tmp_path_factory.mktemp("kimi-linear-flat")
    return path, kimi_tiny_helpers.save_tiny(path, transformers.KimiLinearConfig(**FLAT), seed=3)


def hf_greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(ids, use_cache=False).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt):].tolist()


def test_save_pretrained_writes_the_flat_layout(flat_tiny):
    path, _ = flat_tiny
    saved = json.loads((path / "config.json").read_text())
    assert "linear_attn_config" not in saved
    assert (saved["linear_num_heads"], saved["linear_head_dim"], saved["linear_conv_kernel_dim"]) == (2, 16, 3)
    assert saved["layer_types"] == FLAT["layer_types"]


def test_the_flat_layout_loads_with_transformers_logits(flat_tiny):
    path, hf_model = flat_tiny
    loaded = load_model(path)
    kda = loaded.model.layers[0].self_attn
    assert (kda.num_heads, kda.head_dim) == (2, 16) and loaded.config.conv_width == 3
    assert loaded.config.layer_types == FLAT["layer_types"]
    ids = torch.randint(0, FLAT["vocab_size"], (40,), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = hf_model(ids[None]).logits[0]
    torch.testing.assert_close(prefill_logits(loaded.model, ids, [17, 23]), expected, atol=2e-4, rtol=0)


def test_the_flat_layout_decodes_greedily_as_transformers(flat_tiny):
    path, hf_model = flat_tiny
    prompts = [[5, 17, 99, 3, 42, 8, 77], [120, 1, 2, 3, 1, 2, 3, 1, 2]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    llm = LLM(path, dtype="float32")
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outputs] == [hf_greedy(hf_model, p, 8) for p in prompts]


def rewritten(path, tmp_path, change):
    other = tmp_path / "rewritten"
    shutil.copytree(path, other)
    config = json.loads((other / "config.json").read_text())
    change(config)
    (other / "config.json").write_text(json.dumps(config))
    return other


def test_nested_linear_attn_config_wins_over_the_flat_keys(flat_tiny, tmp_path):
    """transformers takes num_heads, head_dim and short_conv_kernel_size from linear_attn_config
    over the flat keys, and layer_types over the 1-indexed lists."""
    path, _ = flat_tiny

    def nest(config):
        config["linear_attn_config"] = {"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 3,
                                        "kda_layers": [1, 2, 3, 4], "full_attn_layers": []}
        config["linear_num_heads"], config["linear_head_dim"], config["linear_conv_kernel_dim"] = 64, 128, 4

    loaded = load_model(rewritten(path, tmp_path, nest))
    assert (loaded.config.kda_heads, loaded.config.kda_head_dim, loaded.config.conv_width) == (2, 16, 3)
    assert loaded.config.layer_types == FLAT["layer_types"]
    hf = transformers.KimiLinearConfig.from_pretrained(tmp_path / "rewritten")
    assert (hf.linear_num_heads, hf.linear_head_dim, hf.linear_conv_kernel_dim) == (2, 16, 3)


def test_neither_layout_names_both_keys(flat_tiny, tmp_path):
    path, _ = flat_tiny

    def drop(config):
        del config["linear_num_heads"]

    with pytest.raises(ConfigError, match=r"linear_attn_config\.num_heads or linear_num_heads: expected an int > 0, got None"):
        load_model(rewritten(path, tmp_path, drop))
