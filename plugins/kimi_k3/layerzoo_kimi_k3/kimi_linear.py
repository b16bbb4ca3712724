"""Kimi Linear (``KimiLinearForCausalLM``): KDA layers with a NoPE MLA layer every few, MoE MLPs.

- Two config layouts, read as transformers reads them: the released checkpoints' nested
  ``linear_attn_config`` (``num_heads``, ``head_dim``, ``short_conv_kernel_size`` and the **1-indexed**
  ``kda_layers`` / ``full_attn_layers`` lists) and what transformers' ``save_pretrained`` writes,
  flat ``linear_num_heads``, ``linear_head_dim``, ``linear_conv_kernel_dim`` and ``layer_types``.
  A nested value wins over its flat twin; ``layer_types`` wins over the lists.
- MLA is NoPE: the rope part of each head (and the shared ``k_pe``) exists but is never rotated;
  the softmax scale is ``(qk_nope + qk_rope)^-0.5``; the q_a/kv_a norms use eps 1e-6 (as
  transformers' ``KimiLinearRMSNorm`` default), every other norm ``rms_norm_eps``.
- MLP: dense for the first ``first_k_dense_replace`` layers, then DeepSeek-V3's router (sigmoid
  scores, ``e_score_correction_bias`` for the choice only, renormalised, times
  ``routed_scaling_factor``), SwiGLU experts ``w1`` (gate), ``w3`` (up), ``w2`` (down), and ungated
  shared experts of width ``moe_intermediate_size * num_shared_experts``.
"""

from __future__ import annotations

import re

import attrs
import torch
from torch import nn

from layerzoo.config import DecoderConfig, hf
from layerzoo.distributed import parallel_state
from layerzoo.layers.base import DecoderLayer, PreNormDecoderLayer
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.kda import KimiDeltaAttention
from layerzoo.layers.mla import MLAAttention
from layerzoo.layers.mlp import GatedMLP
from layerzoo.layers.model import CausalLM
from layerzoo.layers.moe import SigmoidGroupedTopKRouter, StackedExperts
from layerzoo.layers.norm import RMSNorm
from layerzoo.layers.split_prefill import SplitPrefillLayer
from layerzoo.loading.loader import Target
from layerzoo_kimi_k3 import KDA_KIND, MLA_KIND

LINEAR, FULL = "linear_attention", "full_attention"
MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them without rms_norm_eps


def layer_types_from(linear_attn_config: dict, num_layers: int) -> list[str]:
    """``layer_types`` from the 1-indexed ``kda_layers`` / ``full_attn_layers`` lists."""
    kda, full = linear_attn_config.get("kda_layers"), linear_attn_config.get("full_attn_layers")
    if kda is None or full is None:
        raise ValueError("expected 'layer_types' or linear_attn_config's 'kda_layers' and 'full_attn_layers' (1-indexed lists)")
    types: list[str | None] = [None] * num_layers
    for kind, layers in ((LINEAR, kda), (FULL, full)):
        for layer in layers:
            if not isinstance(layer, int) or not 1 <= layer <= num_layers:
                raise ValueError(f"linear_attn_config: layer {layer!r} is not in 1..{num_layers} (the lists are 1-indexed)")
            types[layer - 1] = kind
    missing = [i + 1 for i, t in enumerate(types) if t is None]
    if missing:
        raise ValueError(f"linear_attn_config: layers {missing} (1-indexed) are in neither kda_layers nor full_attn_layers")
    return types


# (key in linear_attn_config, transformers' flat key, default when neither is given)
KDA_SHAPE_KEYS = (("num_heads", "linear_num_heads", None), ("head_dim", "linear_head_dim", None),
                  ("short_conv_kernel_size", "linear_conv_kernel_dim", 4))


@attrs.frozen(kw_only=True)
class KimiLinearConfig(DecoderConfig):
    max_position_embeddings: int = hf(1048576, key="model_max_length", aliases=("max_position_embeddings",), kind=int)
    linear_attn_config: dict = hf({}, kind=dict)
    # transformers' flat spelling of linear_attn_config's num_heads, head_dim, short_conv_kernel_size
    linear_num_heads: int | None = hf(None, kind=int)
    linear_head_dim: int | None = hf(None, kind=int)
    linear_conv_kernel_dim: int | None = hf(None, kind=int)
    layer_types: list | None = hf(None, kind=list)
    mlp_layer_types: list | None = hf(None, kind=list)
    q_lora_rank: int | None = hf(None, kind=int)
    kv_lora_rank: int = hf(kind=int)
    qk_nope_head_dim: int = hf(kind=int)
    qk_rope_head_dim: int = hf(kind=int)
    v_head_dim: int = hf(kind=int)
    mla_use_nope: bool = hf(True, kind=bool)
    num_experts: int = hf(0, kind=int)
    num_experts_per_token: int = hf(1, aliases=("num_experts_per_tok",), kind=int)
    num_shared_experts: int = hf(0, aliases=("n_shared_experts",), kind=int)
    moe_intermediate_size: int = hf(0, kind=int)
    moe_renormalize: bool = hf(True, aliases=("norm_topk_prob",), kind=bool)
    routed_scaling_factor: float = hf(1.0, kind=float)
    num_expert_group: int = hf(1, aliases=("n_group",), kind=int)
    topk_group: int = hf(1, kind=int)
    first_k_dense_replace: int = hf(1, kind=int)
    moe_router_activation_func: str = hf("sigmoid", kind=str)

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", layer_types_from(self.linear_attn_config, self.num_hidden_layers))
        if len(self.layer_types) != self.num_hidden_layers or set(self.layer_types) - {LINEAR, FULL}:
            raise ValueError(f"layer_types: expected {self.num_hidden_layers} entries of {LINEAR!r} or {FULL!r}, got {self.layer_types}")
        if self.mlp_layer_types is None:
            types = ["dense" if i < self.first_k_dense_replace or not self.num_experts else "sparse" for i in range(self.num_hidden_layers)]
            object.__setattr__(self, "mlp_layer_types", types)
        if not self.mla_use_nope:
            raise ValueError("mla_use_nope: only NoPE MLA (true) is supported for Kimi Linear")
        if self.moe_router_activation_func != "sigmoid":
            raise ValueError(f"moe_router_activation_func: expected 'sigmoid', got {self.moe_router_activation_func!r}")
        self.check_activation()
        for nested, flat, default in KDA_SHAPE_KEYS:
            object.__setattr__(self, flat, self._kda_shape(nested, flat, default))

    def _kda_shape(self, nested: str, flat: str, default: int | None) -> int:
        """``linear_attn_config[nested]`` if given, else the flat key (transformers reads them so)."""
        value = self.linear_attn_config.get(nested, getattr(self, flat))
        value = default if value is None else value
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"linear_attn_config.{nested} or {flat}: expected an int > 0, got {value!r}")
        return value

    def check_activation(self) -> None:
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: expected 'silu', got {self.hidden_act!r}")

    @property
    def kda_heads(self) -> int:
        return self.linear_num_heads

    @property
    def kda_head_dim(self) -> int:
        return self.linear_head_dim

    @property
    def conv_width(self) -> int:
        return self.linear_conv_kernel_dim


def sigmoid_router(config: KimiLinearConfig) -> SigmoidGroupedTopKRouter:
    """The core's DeepSeek-V3 router with Kimi's config names."""
    return SigmoidGroupedTopKRouter(
        hidden_size=config.hidden_size, num_experts=config.num_experts, top_k=config.num_experts_per_token,
        num_groups=config.num_expert_group, topk_groups=config.topk_group, renormalize=config.moe_renormalize,
        routed_scaling_factor=config.routed_scaling_factor,
    )


class KimiMoE(nn.Module):
    """Routed SwiGLU experts plus ungated shared experts (tensor parallel: experts split across the
    ranks, shared experts by intermediate features; one all-reduce of both partial sums)."""

    def __init__(self, config: KimiLinearConfig):
        super().__init__()
        self.gate = sigmoid_router(config)
        self.experts = StackedExperts(config.num_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = (
            GatedMLP(config.hidden_size, config.moe_intermediate_size * config.num_shared_experts, reduce_output=False)
            if config.num_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        out = self.experts(x, weights.to(x.dtype), ids)
        return parallel_state.all_reduce(out if self.shared_experts is None else out + self.shared_experts(x))


def build_mlp(config: KimiLinearConfig, layer_index: int) -> nn.Module:
    if config.mlp_layer_types[layer_index] == "sparse":
        return KimiMoE(config)
    return GatedMLP(config.hidden_size, config.intermediate_size)


class KdaDecoderLayer(SplitPrefillLayer):
    """Input norm → KDA → residual → post norm → MLP or MoE → residual, in three prefill phases."""

    layer_kind = KDA_KIND
    tensor_parallel = True  # the core's KDA, MLP and experts split; KimiMoE reduces once

    def __init__(self, config: KimiLinearConfig, layer_index: int):
        super().__init__(layer_index)
        self.self_attn = KimiDeltaAttention(
            layer_index=layer_index,
            hidden_size=config.hidden_size,
            num_heads=config.kda_heads,
            head_dim=config.kda_head_dim,
            conv_width=config.conv_width,
            norm_eps=config.rms_norm_eps,
            a_log_shape=(1, 1, config.kda_heads, 1),
        )
        self.mlp = build_mlp(config, layer_index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def state_spec(self, dtype: torch.dtype):
        return self.self_attn.state_spec(dtype)

    def prefill_phase1(self, hidden, residual, ctx: ForwardContext):
        """``(recurrence, (normed input, residual))``."""
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        return self.self_attn.phase1(hidden, ctx), (hidden, residual)

    def prefill_phase3(self, o: torch.Tensor, carry, ctx: ForwardContext):
        x, residual = carry
        hidden, residual = self.post_attention_layernorm(self.self_attn.output(o, x), residual)
        return self.mlp(hidden), residual


class MlaDecoderLayer(PreNormDecoderLayer):
    layer_kind = MLA_KIND
    tensor_parallel = True  # heads split, latents replicated (the core's MLA)

    def __init__(self, config: KimiLinearConfig, layer_index: int, prefill: str):
        super().__init__(
            layer_index,
            self_attn=MLAAttention(
                layer_index=layer_index,
                hidden_size=config.hidden_size,
                num_heads=config.num_attention_heads,
                q_lora_rank=config.q_lora_rank,
                kv_lora_rank=config.kv_lora_rank,
                qk_nope_head_dim=config.qk_nope_head_dim,
                qk_rope_head_dim=config.qk_rope_head_dim,
                v_head_dim=config.v_head_dim,
                norm_eps=MLA_NORM_EPS,
                rotary=None,  # NoPE
                prefill=prefill,
                bias=config.attention_bias,
            ),
            mlp=build_mlp(config, layer_index),
            hidden_size=config.hidden_size,
            eps=config.rms_norm_eps,
        )


class KimiLinearForCausalLM(CausalLM):
    config_class = KimiLinearConfig

    def build_layer(self, layer_index: int) -> DecoderLayer:
        config = self.config
        if config.layer_types[layer_index] == FULL:
            return MlaDecoderLayer(config, layer_index, self.engine_config.mla_prefill)
        return KdaDecoderLayer(config, layer_index)


_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight$")


def name_map(config: KimiLinearConfig):
    """Checkpoint keys onto the model: ``block_sparse_moe`` is the layer's ``mlp``; per-expert
    ``w1`` (gate) / ``w3`` (up) / ``w2`` (down) go into the stacked experts."""

    def mapped(key: str):
        key = key.replace(".block_sparse_moe.", ".mlp.")
        match = _EXPERT.match(key)
        if match is None:
            return key
        prefix, expert, w = match.group(1), int(match.group(2)), match.group(3)
        if w == "w2":
            return Target(f"{prefix}.down_proj", (expert,), (config.num_experts,))
        return Target(f"{prefix}.gate_up_proj", (expert, 0 if w == "w1" else 1), (config.num_experts, 2))

    return mapped



