"""Qwen3-Next: Gated DeltaNet layers with one gated full-attention layer in every four.

Differences from Qwen3 that matter: every RMSNorm is zero-centred (``x̂ * (1 + w)``) except the
GDN output norm; the attention's ``q_proj`` yields a query and a sigmoid output gate per head
(interleaved per head, not in two halves); RoPE covers only the first ``partial_rotary_factor``
of each head; the MoE adds a shared expert scaled by ``sigmoid(shared_expert_gate(x))``. The
checkpoint's ``mtp.*`` tensors (the multi-token-prediction head, ``mtp_num_hidden_layers``) are
loaded strictly when speculation asks for ``method "mtp"`` (`layerzoo.layers.mtp`: zero-centred
``pre_fc_norm_embedding`` / ``pre_fc_norm_hidden``, ``fc``, a gated full-attention block with the
model's MLP kind, ``mtp.norm``, the shared LM head; the chained hidden is the normed one, and
position 0 is not masked), and skipped otherwise.
"""

from __future__ import annotations

import attrs
import torch
from torch import nn

from layerzoo.config import DecoderConfig, hf
from layerzoo.distributed import parallel_state
from layerzoo.layers.attention import Attention
from layerzoo.layers.base import PreNormDecoderLayer
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.linear import fuse_linears
from layerzoo.layers.mlp import GatedMLP
from layerzoo.layers.model import CausalLM
from layerzoo.layers.moe import SparseMoE, is_sparse_layer, stacked_expert_target
from layerzoo.layers.mtp import MtpHead, qwen_mtp_head_keys, qwen_mtp_target
from layerzoo.layers.parallel_linear import column_parallel_linear, split_heads
from layerzoo_ssm import GATED_ATTENTION_KIND
from layerzoo_ssm.gated_deltanet import GatedDeltaNetDecoderLayer
from layerzoo_ssm.norms import ZeroCenteredRMSNorm

LINEAR, FULL = "linear_attention", "full_attention"


@attrs.frozen(kw_only=True)
class Qwen3NextConfig(DecoderConfig):
    layer_types: list | None = hf(None, kind=list)
    full_attention_interval: int = hf(4, kind=int)
    linear_num_key_heads: int = hf(kind=int)
    linear_num_value_heads: int = hf(kind=int)
    linear_key_head_dim: int = hf(kind=int)
    linear_value_head_dim: int = hf(kind=int)
    linear_conv_kernel_dim: int = hf(4, kind=int)
    num_experts: int = hf(0, kind=int)
    num_experts_per_tok: int = hf(1, kind=int)
    moe_intermediate_size: int = hf(0, kind=int)
    shared_expert_intermediate_size: int = hf(0, kind=int)
    norm_topk_prob: bool = hf(True, kind=bool)
    decoder_sparse_step: int = hf(1, kind=int)
    mlp_only_layers: list = hf([], kind=list)
    mtp_num_hidden_layers: int = hf(0, aliases=("num_nextn_predict_layers",), kind=int)  # the MTP head's layers

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        if self.layer_types is None:
            types = [FULL if (i + 1) % self.full_attention_interval == 0 else LINEAR for i in range(self.num_hidden_layers)]
            object.__setattr__(self, "layer_types", types)
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise ValueError(
                f"layer_types: expected {self.num_hidden_layers} entries of {LINEAR!r} or {FULL!r}, got {self.layer_types}"
            )

    def is_sparse(self, layer_index: int) -> bool:
        """Whether layer ``layer_index`` uses the MoE block."""
        return is_sparse_layer(
            layer_index,
            num_experts=self.num_experts,
            decoder_sparse_step=self.decoder_sparse_step,
            mlp_only_layers=self.mlp_only_layers,
        )


class SharedExpertMoE(SparseMoE):
    """Routed experts plus one shared expert gated per token by ``sigmoid(shared_expert_gate(x))``."""

    def __init__(self, config: Qwen3NextConfig):
        super().__init__(
            hidden_size=config.hidden_size,
            num_experts=config.num_experts,
            top_k=config.num_experts_per_tok,
            intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=config.norm_topk_prob,
        )
        # its partial sum joins the routed experts' before the one all-reduce (tensor parallel)
        self.shared_expert = GatedMLP(
            config.hidden_size, config.shared_expert_intermediate_size, config.hidden_act, reduce_output=False
        )
        self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)

    # diff with SparseMoE: the gated shared expert is added
    def partial_forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().partial_forward(x) + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)


def build_mlp(config: Qwen3NextConfig, layer_index: int) -> nn.Module:
    if config.is_sparse(layer_index):
        return SharedExpertMoE(config)
    return GatedMLP(config.hidden_size, config.intermediate_size, config.hidden_act)


class GatedAttention(Attention):
    """GQA attention whose ``q_proj`` also yields an output gate: ``o_proj(attn * sigmoid(gate))``."""

    def __init__(self, config: Qwen3NextConfig, layer_index: int, rotary):
        super().__init__(
            layer_index=layer_index,
            hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=config.head_dim,
            rotary=rotary,
            qk_norm_eps=config.rms_norm_eps,
            bias=config.attention_bias,
        )
        # diff with Attention: twice the query width (query | gate per head), (1 + w) QK norms
        heads = config.num_attention_heads  # all ranks'; self.num_heads is this rank's
        self.q_proj = column_parallel_linear(
            config.hidden_size, 2 * heads * self.head_dim, config.attention_bias,
            shard=split_heads(heads, 2 * self.head_dim, f"attention of layer {layer_index}"),
        )
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, config.rms_norm_eps)

    def fuse_projections(self) -> None:
        self.qkv = fuse_linears([self.q_proj, self.k_proj, self.v_proj])
        kv = self.num_kv_heads * self.head_dim
        self.qkv_sizes = (2 * self.num_heads * self.head_dim, kv, kv)
        del self.q_proj, self.k_proj, self.v_proj

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        tokens = x.shape[0]
        q_gate, k, v = self.project_qkv(x)
        q, gate = q_gate.view(tokens, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q.contiguous())
        k = self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim))
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        cos, sin = ctx.cos_sin
        q, k = self.rotary.rotate(q, cos, sin), self.rotary.rotate(k, cos, sin)
        out = ctx.kv_cache.attend(self.layer_index, q, k, v, self.scaling, ctx)
        out = out.reshape(tokens, self.num_heads, self.head_dim) * torch.sigmoid(gate)
        return parallel_state.all_reduce(self.o_proj(out.reshape(tokens, self.num_heads * self.head_dim)))


class GatedAttentionDecoderLayer(PreNormDecoderLayer):
    layer_kind = GATED_ATTENTION_KIND
    tensor_parallel = True

    def __init__(self, config: Qwen3NextConfig, layer_index: int, rotary):
        super().__init__(
            layer_index,
            self_attn=GatedAttention(config, layer_index, rotary),
            mlp=build_mlp(config, layer_index),
            hidden_size=config.hidden_size,
            eps=config.rms_norm_eps,
        )
        # diff with PreNormDecoderLayer: zero-centred norms
        self.input_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3NextForCausalLM(CausalLM):
    config_class = Qwen3NextConfig
    gdn_layout = "grouped"  # fused in_proj_qkvz / in_proj_ba, interleaved per key-head group

    def __init__(self, config, engine_config=None):
        super().__init__(config, engine_config)
        # diff with CausalLM: the final norm is zero-centred too
        self.model.norm = ZeroCenteredRMSNorm(config.hidden_size, config.rms_norm_eps)
        if self.mtp_requested():
            block = GatedAttentionDecoderLayer(config, config.num_hidden_layers, self.rotary)
            self.mtp = MtpHead(
                config.hidden_size, config.rms_norm_eps, block, norm_class=ZeroCenteredRMSNorm,
                mask_position0=False, carry_normed=True,
            )

    def num_mtp_layers(self) -> int:
        return self.config.mtp_num_hidden_layers

    def mtp_checkpoint_keys(self) -> list[str]:
        return qwen_mtp_head_keys()

    def build_layer(self, layer_index: int):
        config = self.config
        if config.layer_types[layer_index] == FULL:
            return GatedAttentionDecoderLayer(config, layer_index, self.rotary)
        return GatedDeltaNetDecoderLayer(
            config, layer_index, layout=self.gdn_layout, mlp=build_mlp(config, layer_index)
        )


def name_map(config: Qwen3NextConfig):
    """Checkpoint keys onto the model: stacked experts; the ``mtp.*`` head onto ``mtp.*`` (dropped by
    the loader when the model was built without its head)."""

    def mapped(key: str):
        if key.startswith("mtp."):
            key = qwen_mtp_target(key)
            if key is None:
                return None
        return stacked_expert_target(key, config.num_experts) or key

    return mapped
