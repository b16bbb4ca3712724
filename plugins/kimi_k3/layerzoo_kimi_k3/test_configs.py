"""Tiny configs for the conformance kit (`register_test_configs`). Kimi Linear's checkpoint is
written by transformers; Kimi K3 has no transformers class, so its checkpoint is this plugin's own
model with random weights (`write_random_checkpoint`)."""

WRITER = "layerzoo.testing.checkpoints:write_transformers_checkpoint"
RANDOM_WRITER = "layerzoo.testing.checkpoints:write_random_checkpoint"

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
    # The multimodal wrapper's text model (the one served): SiTU-GLU, latent MoE, MLA with an
    # output gate and AttnRes blocks of 2 over KDA, KDA, MLA.
    "KimiK3ForConditionalGeneration": dict(
        model_type="kimi_k3", architectures=["KimiK3ForConditionalGeneration"], vision_config={},
        media_placeholder_token_id=100,  # outside the vocabulary: kit prompts never hold it
        tie_word_embeddings=False,
        text_config=dict(
            model_type="kimi_linear", vocab_size=77, hidden_size=32, num_hidden_layers=3, rms_norm_eps=1e-5,
            hidden_act="situ", activation_situ_beta=4.0, activation_situ_linear_beta=25.0,
            intermediate_size=40, first_k_dense_replace=1, num_experts=4, num_experts_per_token=2,
            num_shared_experts=1, moe_intermediate_size=12, routed_expert_hidden_size=16, latent_moe_use_norm=True,
            moe_router_activation_func="sigmoid", num_expert_group=1, topk_group=1, moe_renormalize=True,
            routed_scaling_factor=1.5, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=20,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8, mla_use_nope=True,
            mla_use_output_gate=True, attn_res_block_size=2, max_position_embeddings=4096, tie_word_embeddings=False,
            eos_token_id=None, bos_token_id=None, pad_token_id=None,
            linear_attn_config=dict(num_heads=2, head_dim=8, short_conv_kernel_size=4, gate_lower_bound=-5.0,
                                    use_full_rank_gate=True, kda_layers=[1, 2], full_attn_layers=[3]),
        ),
    ),
}

WRITERS = {"KimiK3ForConditionalGeneration": RANDOM_WRITER}
