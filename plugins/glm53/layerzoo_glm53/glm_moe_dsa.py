"""GLM-5.x (``GlmMoeDsaForCausalLM``, model type ``glm_moe_dsa``): MLA with DSA sparse attention, MoE.

Facts (transformers 5.24 ``models/glm_moe_dsa``):

- Every layer is ``indexed_attention``: MLA with ``q_lora`` and GPT-J (interleaved) RoPE on the rope
  dims; the q_a / kv_a norms use eps 1e-6 whatever ``rms_norm_eps`` says; softmax scale
  ``qk_head_dim^-0.5`` (times yarn's ``mscale²``). The rotary embedding is over
  ``qk_rope_head_dim`` (the config's ``head_dim`` is forced to it).
- The DSA indexer (`layerzoo_glm53.indexer`) restricts each query to ``index_topk`` tokens.
  ``indexer_types[i]`` is ``"full"`` (own indexer) or ``"shared"`` (IndexShare: no indexer weights,
  reuses the previous full layer's top-k); without it the pattern comes from
  ``index_topk_pattern`` (``"F"``/``"S"``) or ``index_topk_freq`` / ``index_skip_topk_offset``.
- MLP: dense for the first ``first_k_dense_replace`` layers (or per ``mlp_layer_types``), else
  DeepSeek-V3's sigmoid ``noaux_tc`` router (correction bias for the choice only, group top-k,
  renormalised, times ``routed_scaling_factor``), SwiGLU experts, and one SwiGLU shared expert of
  width ``moe_intermediate_size * n_shared_experts``.
- The MTP head (DeepSeek's NextN layout at ``model.layers.{num_hidden_layers}``, one layer,
  ``num_nextn_predict_layers``) is built and loaded strictly when speculation asks for
  ``method "mtp"`` (`layerzoo.layers.mtp`): enorm / hnorm / eh_proj / shared_head.norm and a full
  DSA + MoE block with its own indexer; the carried hidden is the normed one (GLM-5, unlike
  DeepSeek-V3). Otherwise its weights are skipped by name, as are ``mtp.*`` keys.
"""

from __future__ import annotations

import re

import attrs
import torch
from torch import nn

from layerzoo.config import DecoderConfig, hf
from layerzoo.distributed import parallel_state
from layerzoo.layers.base import DecoderLayer, PreNormDecoderLayer
from layerzoo.layers.mla import mla_softmax_scale
from layerzoo.layers.mlp import GatedMLP
from layerzoo.layers.model import CausalLM
from layerzoo.layers.moe import SigmoidGroupedTopKRouter, StackedExperts, stacked_expert_target
from layerzoo.layers.mtp import MtpHead, nextn_head_keys, nextn_target
from layerzoo_glm53 import DSA_KIND
from layerzoo_glm53.dsa_attention import DsaMLAAttention
from layerzoo_glm53.indexer import LightningIndexer

MLA_NORM_EPS = 1e-6  # q_a_layernorm / kv_a_layernorm: transformers builds them without rms_norm_eps
FULL, SHARED = "full", "shared"


def indexer_types_from(data_pattern, freq: int, offset: int, num_layers: int) -> list[str]:
    """transformers' default ``indexer_types``: from ``index_topk_pattern`` or freq/offset."""
    if data_pattern is not None:
        if isinstance(data_pattern, str):
            bad = sorted(set(data_pattern) - {"F", "S"})
            if bad:
                raise ValueError(f"index_topk_pattern: expected only 'F' and 'S', got {bad}")
            return [{"F": FULL, "S": SHARED}[c] for c in data_pattern]
        return list(data_pattern)
    freq = max(freq, 1)
    return [FULL if max(i - offset + 1, 0) % freq == 0 else SHARED for i in range(num_layers)]


@attrs.frozen(kw_only=True)
class GlmMoeDsaConfig(DecoderConfig):
    q_lora_rank: int = hf(kind=int)  # required: the indexer reads the q_lora residual
    kv_lora_rank: int = hf(kind=int)
    qk_nope_head_dim: int = hf(kind=int)
    qk_rope_head_dim: int = hf(kind=int)
    v_head_dim: int = hf(kind=int)
    n_routed_experts: int = hf(0, aliases=("num_local_experts",), kind=int)
    num_experts_per_tok: int = hf(1, kind=int)
    n_shared_experts: int = hf(1, kind=int)
    moe_intermediate_size: int = hf(0, kind=int)
    norm_topk_prob: bool = hf(True, kind=bool)
    routed_scaling_factor: float = hf(1.0, kind=float)
    n_group: int = hf(1, kind=int)
    topk_group: int = hf(1, kind=int)
    first_k_dense_replace: int = hf(3, kind=int)
    mlp_layer_types: list | None = hf(None, kind=list)
    index_topk: int = hf(2048, kind=int)
    index_head_dim: int = hf(128, kind=int)
    index_n_heads: int = hf(32, kind=int)
    indexer_types: list | None = hf(None, kind=list)
    index_topk_pattern: object = hf(None, kind=(str, list))
    index_topk_freq: int = hf(1, kind=int)
    index_skip_topk_offset: int = hf(2, kind=int)
    num_nextn_predict_layers: int = hf(0, kind=int)  # the MTP layers after the decoder

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        object.__setattr__(self, "head_dim", self.qk_rope_head_dim)  # the rotary is over the rope dims
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: expected 'silu', got {self.hidden_act!r}")
        n = self.num_hidden_layers
        if self.mlp_layer_types is None:
            dense = min(self.first_k_dense_replace, n)
            object.__setattr__(self, "mlp_layer_types", ["dense"] * dense + ["sparse"] * (n - dense))
        if len(self.mlp_layer_types) != n or set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types: expected {n} entries of 'dense' or 'sparse', got {self.mlp_layer_types}")
        if "sparse" in self.mlp_layer_types and (self.n_routed_experts < 1 or self.n_routed_experts % self.n_group):
            raise ValueError(f"n_routed_experts: expected a positive multiple of n_group ({self.n_group}), got {self.n_routed_experts}")
        if self.indexer_types is None:
            types = indexer_types_from(self.index_topk_pattern, self.index_topk_freq, self.index_skip_topk_offset, n)
            object.__setattr__(self, "indexer_types", types)
        types = self.indexer_types
        if len(types) != n or set(types) - {FULL, SHARED} or types[0] != FULL:
            raise ValueError(f"indexer_types: expected {n} entries of 'full' or 'shared', the first 'full', got {types}")
        if self.index_topk < 1:
            raise ValueError(f"index_topk: expected an int >= 1, got {self.index_topk}")
        if not 0 < self.qk_rope_head_dim <= self.index_head_dim or self.qk_rope_head_dim % 2:
            raise ValueError(f"index_head_dim: expected at least qk_rope_head_dim ({self.qk_rope_head_dim}, even), got {self.index_head_dim}")


class GlmMoE(nn.Module):
    """Routed SwiGLU experts plus the shared expert (tensor parallel: experts split across the ranks,
    the shared expert by intermediate features; one all-reduce of both partial sums)."""

    def __init__(self, config: GlmMoeDsaConfig):
        super().__init__()
        self.gate = SigmoidGroupedTopKRouter(
            hidden_size=config.hidden_size, num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
            num_groups=config.n_group, topk_groups=config.topk_group, renormalize=config.norm_topk_prob,
            routed_scaling_factor=config.routed_scaling_factor,
        )
        self.experts = StackedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size)
        self.shared_experts = GatedMLP(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, reduce_output=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        return parallel_state.all_reduce(self.experts(x, weights.to(x.dtype), ids) + self.shared_experts(x))


class DsaDecoderLayer(PreNormDecoderLayer):
    layer_kind = DSA_KIND
    tensor_parallel = True  # MLA heads split, indexer replicated, experts split


class GlmMoeDsaForCausalLM(CausalLM):
    config_class = GlmMoeDsaConfig

    def __init__(self, config: GlmMoeDsaConfig, engine_config=None):
        super().__init__(config, engine_config)
        if self.mtp_requested():
            # The NextN block: a full DSA layer (own indexer) with the MoE MLP, at the index after the decoder.
            block = self._layer(config.num_hidden_layers, full=True, sparse=config.n_routed_experts > 0)
            self.mtp = MtpHead(config.hidden_size, config.rms_norm_eps, block, mask_position0=True, carry_normed=True)

    def num_mtp_layers(self) -> int:
        return self.config.num_nextn_predict_layers

    def mtp_checkpoint_keys(self) -> list[str]:
        return nextn_head_keys(self.config.num_hidden_layers)

    def build_layer(self, layer_index: int) -> DecoderLayer:
        c = self.config
        return self._layer(layer_index, full=c.indexer_types[layer_index] == FULL, sparse=c.mlp_layer_types[layer_index] == "sparse")

    def _layer(self, layer_index: int, *, full: bool, sparse: bool) -> DecoderLayer:
        c = self.config
        indexer = None
        if full:
            indexer = LightningIndexer(
                layer_index=layer_index, hidden_size=c.hidden_size, q_lora_rank=c.q_lora_rank,
                num_heads=c.index_n_heads, head_dim=c.index_head_dim, index_topk=c.index_topk,
            )
        attn = DsaMLAAttention(
            indexer=indexer,
            share_from=None if full else self.__dict__["_last_full_attention"],
            layer_index=layer_index, hidden_size=c.hidden_size, num_heads=c.num_attention_heads,
            q_lora_rank=c.q_lora_rank, kv_lora_rank=c.kv_lora_rank, qk_nope_head_dim=c.qk_nope_head_dim,
            qk_rope_head_dim=c.qk_rope_head_dim, v_head_dim=c.v_head_dim, norm_eps=MLA_NORM_EPS,
            rotary=self.rotary, interleaved_rope=True,
            softmax_scale=mla_softmax_scale(c.qk_nope_head_dim + c.qk_rope_head_dim, c.rope),
            bias=c.attention_bias,
        )
        if full:
            self.__dict__["_last_full_attention"] = attn  # plain attribute: IndexShare's source, not a submodule
        mlp = GlmMoE(c) if sparse else GatedMLP(c.hidden_size, c.intermediate_size)
        return DsaDecoderLayer(layer_index, self_attn=attn, mlp=mlp, hidden_size=c.hidden_size, eps=c.rms_norm_eps)


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def name_map(config: GlmMoeDsaConfig):
    """Checkpoint keys onto the model: per-expert ``gate/up/down_proj`` stacked; the first NextN
    layer onto ``mtp.*`` (dropped by the loader when the model was built without its head), any
    further ones and ``mtp.*`` keys skipped."""

    def mapped(key: str):
        if key.startswith("mtp."):
            return None
        layer = _LAYER.match(key)
        if layer is not None and int(layer.group(1)) >= config.num_hidden_layers:
            if int(layer.group(1)) > config.num_hidden_layers:
                return None  # NextN layers past the first: one head is served, chained
            key = nextn_target(key, config.num_hidden_layers)
            if key is None:
                return None
        return stacked_expert_target(key, config.n_routed_experts) or key

    return mapped
