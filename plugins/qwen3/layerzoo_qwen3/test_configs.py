"""Tiny configs for the conformance kit (`register_test_configs`): one per architecture."""

WRITER = "layerzoo.testing.checkpoints:write_transformers_checkpoint"

CONFIGS = {
    "Qwen3ForCausalLM": dict(
        model_type="qwen3", architectures=["Qwen3ForCausalLM"],
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    ),
    "Qwen2ForCausalLM": dict(
        model_type="qwen2", architectures=["Qwen2ForCausalLM"],
        vocab_size=93, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, use_sliding_window=False,
        max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    ),
    "Qwen3MoeForCausalLM": dict(
        model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
        vocab_size=89, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=8,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
        max_position_embeddings=512, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    ),
}
