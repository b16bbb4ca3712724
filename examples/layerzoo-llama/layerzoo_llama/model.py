"""Llama and Mistral, assembled from the core's public building blocks.

Llama is a pre-norm GQA decoder: RMSNorm, attention with RoPE (plain, linear, llama3 or YaRN
scaling, all read by `layerzoo.config.RopeConfig`), SwiGLU MLP. Mistral is the same network; its
configs may ask for sliding-window attention, which this plugin refuses by name unless the window
is at least the model's whole context (then it never masks anything).
"""

from __future__ import annotations

import attrs

from layerzoo.config import DecoderConfig, hf
from layerzoo.layers.attention import Attention
from layerzoo.layers.base import PreNormDecoderLayer
from layerzoo.layers.mlp import GatedMLP
from layerzoo.layers.model import CausalLM
from layerzoo_llama import LLAMA_KIND


@attrs.frozen(kw_only=True)
class LlamaConfig(DecoderConfig):
    mlp_bias: bool = hf(False, kind=bool)

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        if self.mlp_bias:
            raise ValueError("mlp_bias=true is not supported (expected false: the gated MLP has no biases)")


@attrs.frozen(kw_only=True)
class MistralConfig(LlamaConfig):
    sliding_window: int | None = hf(None, kind=int)

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        # A window covering every position the model can see masks nothing: full attention.
        if self.sliding_window is not None and self.sliding_window < self.max_position_embeddings:
            raise ValueError(
                f"sliding_window={self.sliding_window} (sliding-window attention) is not supported by "
                f"layerzoo-llama; expected null or at least max_position_embeddings ({self.max_position_embeddings})"
            )


class LlamaDecoderLayer(PreNormDecoderLayer):
    layer_kind = LLAMA_KIND
    tensor_parallel = True  # built from the core's sharding attention and MLP

    def __init__(self, config: LlamaConfig, layer_index: int, rotary):
        super().__init__(
            layer_index,
            self_attn=Attention(
                layer_index=layer_index,
                hidden_size=config.hidden_size,
                num_heads=config.num_attention_heads,
                num_kv_heads=config.num_key_value_heads,
                head_dim=config.head_dim,
                rotary=rotary,
                bias=config.attention_bias,  # Llama's attention_bias covers q, k, v and o
            ),
            mlp=GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act),
            hidden_size=config.hidden_size,
            eps=config.rms_norm_eps,
        )


class LlamaForCausalLM(CausalLM):
    config_class = LlamaConfig

    def build_layer(self, layer_index: int):
        return LlamaDecoderLayer(self.config, layer_index, self.rotary)


class MistralForCausalLM(LlamaForCausalLM):
    config_class = MistralConfig
