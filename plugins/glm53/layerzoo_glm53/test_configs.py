"""Tiny configs for the conformance kit (`register_test_configs`): one per architecture.

GLM-5 with ``index_topk`` far below the kit's prompt lengths, so the sparse selection decides the
outputs, and 8 indexer heads, so exact ReLU-score ties at the cut are rare (see the plugin's tests).
GLM-5.3-Flash likewise (two pools of 4 kept, plus the raw tail), with both its layer kinds, an
IndexShare layer, 3 mHC streams and MoE.
"""

WRITER = "layerzoo.testing.checkpoints:write_transformers_checkpoint"

CONFIGS = {
    "GlmMoeDsaForCausalLM": dict(
        model_type="glm_moe_dsa", architectures=["GlmMoeDsaForCausalLM"],
        vocab_size=131, hidden_size=48, intermediate_size=64, moe_intermediate_size=24,
        num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=24, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=12,
        n_routed_experts=6, num_experts_per_tok=2, n_group=2, topk_group=1, n_shared_experts=1,
        routed_scaling_factor=2.5, first_k_dense_replace=1,
        index_topk=8, index_head_dim=16, index_n_heads=8,
        indexer_types=["full", "full", "shared", "full"],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        eos_token_id=None, bos_token_id=None, pad_token_id=None,
    ),
    "Glm5NextForConditionalGeneration": dict(
        model_type="glm5_next", architectures=["Glm5NextForConditionalGeneration"],
        text_config=dict(
            vocab_size=131, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
            num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=2,
            kv_lora_rank=16, q_lora_rank=12, qk_rope_head_dim=0, qk_nope_head_dim=8, v_head_dim=8,
            n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, routed_scaling_factor=2.5,
            mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
            layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
            indexer_types=["full", "full", "shared", "full"],
            index_topk=8, index_kpool=4, index_head_dim=16, index_n_heads=8,
            linear_num_heads=2, linear_head_dim=8, hc_mult=3, swiglu_limit=1.5,
            eos_token_id=None, bos_token_id=None, pad_token_id=None,
        ),
        vision_config=dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=32,
                           projection_intermediate_size=16),
    ),
}
