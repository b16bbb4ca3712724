"""Tiny configs for the conformance kit (`register_test_configs`): one per architecture. The
conditional-generation wrappers carry a one-block vision tower that the served text model skips."""

WRITER = "layerzoo.testing.checkpoints:write_transformers_checkpoint"

_NONE_IDS = dict(eos_token_id=None, bos_token_id=None, pad_token_id=None)

CONFIGS = {
    "Qwen3NextForCausalLM": dict(
        model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"],
        vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, full_attention_interval=2,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16,
        decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
        max_position_embeddings=512, tie_word_embeddings=False, **_NONE_IDS,
    ),
    "Qwen3_5ForCausalLM": dict(
        model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"],
        vocab_size=103, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
        max_position_embeddings=512, tie_word_embeddings=False, **_NONE_IDS,
    ),
    "Qwen3_5MoeForCausalLM": dict(
        model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"],
        vocab_size=107, hidden_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"],
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=12,
        max_position_embeddings=512, tie_word_embeddings=False, **_NONE_IDS,
    ),
    "Mamba2ForCausalLM": dict(
        model_type="mamba2", architectures=["Mamba2ForCausalLM"],
        vocab_size=83, hidden_size=32, num_hidden_layers=2, state_size=8, head_dim=8, num_heads=8,
        expand=2, n_groups=2, conv_kernel=4, chunk_size=16, tie_word_embeddings=False, **_NONE_IDS,
    ),
}


# A one-block vision tower: the checkpoint holds it, the text model skips it.
_VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32,
               patch_size=2, temporal_patch_size=2, spatial_merge_size=1)


def _text(architecture: str) -> dict:
    return {k: v for k, v in CONFIGS[architecture].items() if k != "architectures"}


CONFIGS["Qwen3_5ForConditionalGeneration"] = dict(
    model_type="qwen3_5", architectures=["Qwen3_5ForConditionalGeneration"],
    text_config=_text("Qwen3_5ForCausalLM"), vision_config=_VISION, tie_word_embeddings=False,
)
CONFIGS["Qwen3_5MoeForConditionalGeneration"] = dict(
    model_type="qwen3_5_moe", architectures=["Qwen3_5MoeForConditionalGeneration"],
    text_config=_text("Qwen3_5MoeForCausalLM"), vision_config=_VISION, tie_word_embeddings=False,
)
