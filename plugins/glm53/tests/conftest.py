import os

# The op tests run the Triton kernels under the interpreter on CPU; must be set before triton is
# imported anywhere in the process (an explicit value, e.g. 0 on a GPU, is honoured).
os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")
transformers = pytest.importorskip("transformers")

from layerzoo.testing import write_word_tokenizer  # noqa: E402

# Large enough that greedy steps are not near-ties between two tokens.
INIT_RANGE = 0.25
INDEX_TOPK = 8  # far below the prompt lengths, so the sparse selection decides the outputs


def glm_config(**overrides):
    """A tiny GLM-5 config: 4 layers (dense first, MoE after), IndexShare on layer 2, index_topk 8.

    Ties: the indexer score of a key is Σ_h w_h · relu(q_h · k); it is exactly 0 (and ties with
    other zero keys, where transformers' top-k order is arbitrary) only when every head's dot
    product is negative. With 8 indexer heads of random weights that happens for ~1/256 of the
    keys, and it matters only at the k-th place of a row that has fewer than k positive scores:
    the tests then could flip. They do not on these seeds, and `test_indexer_scores_have_no_ties_at_the_cut`
    checks the premise on the reference model itself.
    """
    base = dict(
        vocab_size=131, hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=24, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.5, first_k_dense_replace=1,
        index_topk=INDEX_TOPK, index_head_dim=16, index_n_heads=8,
        indexer_types=["full", "full", "shared", "full"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    base.update(overrides)
    return transformers.GlmMoeDsaConfig(**base)


def save_tiny(path, config, *, seed: int = 0):
    """Build a random transformers GLM-5, perturb its norms and router bias, save it."""
    torch.manual_seed(seed)
    config.initializer_range = INIT_RANGE
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    model = transformers.GlmMoeDsaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm.bias")):
                p.add_(torch.randn_like(p) * 0.2)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(path)
    write_word_tokenizer(path, config.vocab_size)
    return model


def hf_greedy(model, prompt, steps):
    """transformers' greedy continuation, recomputing the whole sequence each step."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            nxt = model(ids, use_cache=False).logits[0, -1].argmax()
            ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


@pytest.fixture(scope="session")
def glm_helpers():
    """The helpers above, for test modules (conftest is not importable under importlib mode)."""
    import types

    return types.SimpleNamespace(save_tiny=save_tiny, glm_config=glm_config, hf_greedy=hf_greedy)


@pytest.fixture(scope="session")
def glm_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm-moe-dsa")
    return path, save_tiny(path, glm_config())


# -- GLM-5.3-Flash (glm5_next) ----------------------------------------------------------------

KPOOL = 4
NEXT_INDEX_TOPK = 8  # two pools of 4 (plus the raw tail): far below the prompt lengths


def glm5next_text_config(**overrides):
    """A tiny GLM-5.3-Flash text config: KDA, two indexed layers (the second IndexShare), KDA; 3
    mHC streams; dense first layer, MoE after; index_topk 8 in pools of 4; 8 indexer heads.

    Ties: as for GLM-5 (see `glm_config`), a pool's index score is exactly 0 only when all 8
    heads' dot products with it are negative; `test_pool_scores_have_no_ties_at_the_cut` checks
    that no row that really chooses has its cut within rounding on these seeds.
    """
    base = dict(
        vocab_size=131, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
        kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=0, qk_nope_head_dim=8, v_head_dim=8,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"],
        index_topk=NEXT_INDEX_TOPK, index_kpool=KPOOL, index_head_dim=16, index_n_heads=8,
        linear_num_heads=2, linear_head_dim=8, hc_mult=3, swiglu_limit=1.5, pad_token_id=None,
        eos_token_id=None, bos_token_id=None,
    )
    base.update(overrides)
    return base


def save_tiny_next(path, text_config, *, seed: int = 0):
    """Build a random transformers GLM-5.3-Flash (a one-block vision tower), perturb what starts
    at an identity or a constant (norms, KDA gate, mHC weights, k-pool gate and position
    embedding, router bias), save it; returns the model."""
    torch.manual_seed(seed)
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=text_config["hidden_size"],
                  projection_intermediate_size=16)
    config = transformers.Glm5NextConfig(text_config=dict(text_config, initializer_range=INIT_RANGE), vision_config=vision)
    config._attn_implementation = "eager"
    config._experts_implementation = "eager"
    config.text_config._attn_implementation = "eager"
    model = transformers.Glm5NextForConditionalGeneration(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("norm.weight", "norm.bias", "A_log", "dt_bias", "hc.base", "hc.scale")):
                p.add_(torch.randn_like(p) * 0.2)
            elif name.endswith("hc.fn"):
                p.normal_(0, 0.3)
            elif name.endswith(("index_kpool_compress_ape", "index_kpool_compress_gate")):
                p.normal_(0, 0.5)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.1)
    model.save_pretrained(path)
    write_word_tokenizer(path, text_config["vocab_size"])
    return model


@pytest.fixture(scope="session")
def next_helpers():
    import types

    return types.SimpleNamespace(save_tiny=save_tiny_next, text_config=glm5next_text_config, hf_greedy=hf_greedy)


@pytest.fixture(scope="session")
def next_tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("glm5-next")
    return path, save_tiny_next(path, glm5next_text_config())
