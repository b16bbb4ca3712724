"""Tiny configs for the conformance kit (`register_test_configs`). Kimi K3 has no transformers
class to write a random checkpoint with; Kimi Linear covers both layer kinds."""

WRITER = "layerzoo.testing.checkpoints:write_transformers_checkpoint"

CONFIGS = {
    "KimiLinearForCausalLM": dict(
        model_type="kimi_linear", architectures=["KimiLinearForCausalLM"],
        vocab_size=79, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
        num_experts=4, num_experts_per_token=2, num_shared_experts=1, routed_scaling_factor=2.446,
        linear_attn_config={"head_dim": 8, "num_heads": 2, "short_conv_kernel_size": 4,
                            "kda_layers": [1], "full_attn_layers": [2]},
        first_k_dense_replace=1, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    ),
}
