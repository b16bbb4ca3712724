"""Tiny configs for the conformance kit (`register_test_configs`): one per architecture."""

WRITER = "layerzoo.testing.checkpoints:write_transformers_checkpoint"

_COMMON = dict(
    vocab_size=127, hidden_size=48, intermediate_size=80, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
    tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
)

CONFIGS = {
    "LlamaForCausalLM": dict(model_type="llama", architectures=["LlamaForCausalLM"], **_COMMON),
    "MistralForCausalLM": dict(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=None, **_COMMON),
}
