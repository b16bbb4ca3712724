"""Qwen3, Qwen3-MoE and Qwen2, assembled from the core's building blocks.

Qwen3 is a pre-norm GQA decoder whose attention RMS-normalises q and k per head before RoPE.
Qwen3-MoE is Qwen3 with the MLP of some layers replaced by a softmax top-k MoE.
Qwen2 is Qwen3 without the QK-norm and with biases on q, k and v (not on o).

A Qwen3 checkpoint may carry a multi-token-prediction head in Qwen3-Next's layout (released Qwen3
checkpoints have none; the embedded default model does): ``mtp.pre_fc_norm_embedding``,
``mtp.pre_fc_norm_hidden``, ``mtp.fc`` [H, 2H], ``mtp.layers.0.*`` (one decoder block of the
model's own kind, keys as ``model.layers.N.*``) and ``mtp.norm``, declared by
``mtp_num_hidden_layers`` (alias ``num_nextn_predict_layers``) in config.json. Unlike Qwen3-Next the
norms are plain RMSNorms (Qwen3's own kind). It is built and strictly loaded only when speculation
asks for ``method "mtp"`` (`layerzoo.layers.mtp`); otherwise its keys are skipped.
"""

from __future__ import annotations

import attrs

from layerzoo.config import DecoderConfig, hf
from layerzoo.layers.attention import Attention
from layerzoo.layers.base import PreNormDecoderLayer
from layerzoo.layers.mlp import GatedMLP
from layerzoo.layers.model import CausalLM
from layerzoo.layers.moe import SparseMoE, is_sparse_layer
from layerzoo.layers.mtp import MtpHead, qwen_mtp_head_keys
from layerzoo_qwen3 import DENSE_KIND, MOE_KIND, QWEN2_KIND


@attrs.frozen(kw_only=True)
class Qwen3Config(DecoderConfig):
    use_sliding_window: bool = hf(False, kind=bool)
    mtp_num_hidden_layers: int = hf(0, aliases=("num_nextn_predict_layers",), kind=int)  # the MTP head's layers

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        if self.use_sliding_window:
            raise ValueError("use_sliding_window=true is not supported yet (expected false)")


@attrs.frozen(kw_only=True)
class Qwen3MoeConfig(Qwen3Config):
    num_experts: int = hf(0, aliases=("num_local_experts",), kind=int)
    num_experts_per_tok: int = hf(1, kind=int)
    moe_intermediate_size: int = hf(0, kind=int)
    norm_topk_prob: bool = hf(False, kind=bool)
    decoder_sparse_step: int = hf(1, kind=int)
    mlp_only_layers: list = hf([], kind=list)

    def is_sparse(self, layer_index: int) -> bool:
        """Whether layer ``layer_index`` uses the MoE block."""
        return is_sparse_layer(
            layer_index,
            num_experts=self.num_experts,
            decoder_sparse_step=self.decoder_sparse_step,
            mlp_only_layers=self.mlp_only_layers,
        )


class Qwen3DecoderLayer(PreNormDecoderLayer):
    layer_kind = DENSE_KIND
    tensor_parallel = True  # built from the core's sharding attention, MLP and MoE blocks

    def __init__(self, config: Qwen3Config, layer_index: int, rotary):
        super().__init__(
            layer_index,
            self_attn=self.build_attention(config, layer_index, rotary),
            mlp=self.build_mlp(config, layer_index),
            hidden_size=config.hidden_size,
            eps=config.rms_norm_eps,
        )

    def build_attention(self, config: Qwen3Config, layer_index: int, rotary):
        return Attention(
            layer_index=layer_index,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            rotary=rotary,
            qk_norm_eps=config.rms_norm_eps,  # per-head QK-norm: the Qwen3 difference from Llama
            bias=config.attention_bias,
        )

    def build_mlp(self, config: Qwen3Config, layer_index: int):
        return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)


class Qwen3MoeDecoderLayer(Qwen3DecoderLayer):
    layer_kind = MOE_KIND
    tensor_parallel = True

    # diff with Qwen3DecoderLayer: sparse layers swap the MLP for the MoE block
    def build_mlp(self, config: Qwen3MoeConfig, layer_index: int):
        if not config.is_sparse(layer_index):
            return super().build_mlp(config, layer_index)
        return SparseMoE(
            hidden_size=config.hidden_size,
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=config.norm_topk_prob,
        )


class Qwen2DecoderLayer(Qwen3DecoderLayer):
    layer_kind = QWEN2_KIND
    tensor_parallel = True

    # diff with Qwen3DecoderLayer: no QK-norm; q/k/v always carry biases, o never does
    def build_attention(self, config: Qwen3Config, layer_index: int, rotary):
        return Attention(
            layer_index=layer_index,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            rotary=rotary,
            bias=True,
            output_bias=False,
        )


class Qwen3ForCausalLM(CausalLM):
    config_class = Qwen3Config
    decoder_layer = Qwen3DecoderLayer

    def __init__(self, config, engine_config=None):
        super().__init__(config, engine_config)
        if self.mtp_requested():
            # Qwen3-Next's head convention (no position-0 mask, the normed hidden chained) around
            # one more decoder block of the model's kind, its KV one more layer of the pool.
            block = self.build_layer(config.num_hidden_layers)
            self.mtp = MtpHead(config.hidden_size, config.rms_norm_eps, block, mask_position0=False, carry_normed=True)

    def num_mtp_layers(self) -> int:
        return self.config.mtp_num_hidden_layers

    def mtp_checkpoint_keys(self) -> list[str]:
        return qwen_mtp_head_keys()

    def build_layer(self, layer_index: int):
        return self.decoder_layer(self.config, layer_index, self.rotary)


class Qwen3Model(Qwen3ForCausalLM):
    """A Qwen3 decoder saved without its LM head (``architectures: ["Qwen3Model"]``, as
    Qwen3-Embedding is): an embedder whose embeddings are the last token's final hidden state."""

    has_lm_head = False
    default_pooling = "last"


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    config_class = Qwen3MoeConfig
    decoder_layer = Qwen3MoeDecoderLayer


class Qwen2ForCausalLM(Qwen3ForCausalLM):
    # Qwen2Config has the keys Qwen3Config reads (head_dim absent: hidden_size // heads).
    decoder_layer = Qwen2DecoderLayer
