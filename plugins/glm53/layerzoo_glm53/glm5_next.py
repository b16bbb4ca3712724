"""GLM-5.3-Flash (``Glm5NextForConditionalGeneration``, model type ``glm5_next``): its text model.

Facts (transformers 5.24 ``models/glm5_next``, the reference for parity):

- ``layer_types[i]``: ``linear_attention`` (KDA with the lower-bounded gate
  ``g = linear_lower_bound · σ(exp(A_log) · (f + dt_bias))``, the core's `KimiDeltaAttention`, whose
  conv runs in fp32) or ``indexed_attention`` (NoPE MLA with ``q_lora`` over the tokens the k-pool
  indexer selects, `layerzoo_glm53.kpool_indexer`); default every 4th layer (``i % 4 == 3``)
  indexed. ``indexer_types`` as GLM-5's, but a "shared" layer must directly follow a "full"
  indexed layer (transformers hands the top-k only from one decoder layer to the next).
- The MLA norms use ``rms_norm_eps``; the softmax scale is ``qk_nope_head_dim^-0.5`` (no rope dims).
- mHC around both sublayers of every layer (`HyperConnection`): ``hc_mult`` residual streams, the
  embedding copied into each; the streams are averaged before the final norm.
- SwiGLU clamped (gate ``<= swiglu_limit``, up in ``±swiglu_limit``) in the dense MLPs, the
  shared expert and the routed experts; dense for the first ``min(3, layers)`` layers (or per
  ``mlp_layer_types``), else GLM-5's ``noaux_tc`` router.
- The vision tower (``model.visual.*``) is skipped by name; prompts with the image or video
  placeholder token are refused.
- The MTP layer (NextN at ``layers.{num_hidden_layers}``, ``num_nextn_predict_layers``) is built and
  loaded when speculation asks for ``method "mtp"`` (`layerzoo.layers.mtp`, skipped by name
  otherwise): enorm / hnorm / eh_proj / shared_head.norm around a k-pool DSA block with its own
  indexer and the clamped MoE, with plain residuals: vLLM runs the MTP layer without mHC, so any
  ``hc_*`` tensors of that layer are skipped. Position 0 masked and the normed hidden carried, as
  GLM-5's head (unverified for this model: random-weight tests cannot tell).
"""

from __future__ import annotations

import re

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from layerzoo.config import DecoderConfig, hf
from layerzoo.errors import UserError
from layerzoo.kernels.moe_grouped_matmul.reference import clamped_swiglu
from layerzoo.layers.base import DecoderLayer, PreNormDecoderLayer
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.kda import KimiDeltaAttention
from layerzoo.layers.kv_cache import KVCacheSpec
from layerzoo.layers.mlp import GatedMLP
from layerzoo.layers.model import CausalLM
from layerzoo.layers.moe import StackedExperts, stacked_expert_target
from layerzoo.layers.mtp import MtpHead, nextn_head_keys, nextn_target
from layerzoo.layers.norm import RMSNorm
from layerzoo.layers.split_prefill import three_phase_step
from layerzoo.plugins.ops import kernel
from layerzoo_glm53 import GLM5_NEXT_DSA_KIND, GLM5_NEXT_KDA_KIND
from layerzoo_glm53.dsa_attention import DsaMLAAttention
from layerzoo_glm53.glm_moe_dsa import FULL, SHARED, GlmMoE, indexer_types_from
from layerzoo_glm53.kpool_indexer import KPoolIndexer

LINEAR, INDEXED = "linear_attention", "indexed_attention"
# checkpoint spellings of the indexed layer (transformers folds them into "indexed_attention")
_INDEXED_ALIASES = {"full_attention": INDEXED, "deepseek_sparse_attention": INDEXED}


@attrs.frozen(kw_only=True)
class Glm5NextConfig(DecoderConfig):
    q_lora_rank: int = hf(kind=int)
    kv_lora_rank: int = hf(kind=int)
    qk_nope_head_dim: int = hf(kind=int)
    qk_rope_head_dim: int = hf(0, kind=int)
    v_head_dim: int = hf(kind=int)
    n_routed_experts: int = hf(0, aliases=("num_local_experts",), kind=int)
    num_experts_per_tok: int = hf(1, kind=int)
    n_shared_experts: int = hf(1, kind=int)
    moe_intermediate_size: int = hf(0, kind=int)
    norm_topk_prob: bool = hf(True, kind=bool)
    routed_scaling_factor: float = hf(1.0, kind=float)
    n_group: int = hf(1, kind=int)
    topk_group: int = hf(1, kind=int)
    mlp_layer_types: list | None = hf(None, kind=list)
    layer_types: list | None = hf(None, kind=list)
    index_topk: int = hf(2048, kind=int)
    index_head_dim: int = hf(128, kind=int)
    index_n_heads: int = hf(32, kind=int)
    index_kpool: int = hf(16, kind=int)
    index_kpool_always_select_tail: bool = hf(True, kind=bool)
    indexer_types: list | None = hf(None, kind=list)
    index_topk_pattern: object = hf(None, kind=(str, list))
    index_topk_freq: int = hf(1, kind=int)
    index_skip_topk_offset: int = hf(2, kind=int)
    swiglu_limit: float = hf(10.0, kind=float)
    linear_head_dim: int = hf(128, kind=int)
    linear_num_heads: int = hf(64, kind=int)
    linear_conv_kernel_dim: int = hf(4, kind=int)
    linear_lower_bound: float | None = hf(-5.0, kind=float)
    linear_attn_config: dict | None = hf(None, kind=dict)
    hc_mult: int = hf(4, kind=int)
    hc_eps: float = hf(1e-6, kind=float)
    hc_sinkhorn_iters: int = hf(20, kind=int)
    image_token_id: int | None = hf(None, kind=int)
    video_token_id: int | None = hf(None, kind=int)
    num_nextn_predict_layers: int = hf(0, kind=int)  # the MTP layers after the decoder

    @classmethod
    def from_hf(cls, data, source: str = "config.json"):
        # transformers forces head_dim to the rope dims (0 here): the field means nothing for NoPE
        return super().from_hf({k: v for k, v in data.items() if k != "head_dim"}, source)

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        n = self.num_hidden_layers
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act: expected 'silu', got {self.hidden_act!r}")
        if self.qk_rope_head_dim != 0:
            raise ValueError(f"qk_rope_head_dim: GLM-5.3-Flash's MLA is NoPE (0), got {self.qk_rope_head_dim}")
        self._read_linear_attn_config()
        if self.layer_types is None:
            object.__setattr__(self, "layer_types", [INDEXED if i % 4 == 3 else LINEAR for i in range(n)])
        types = [_INDEXED_ALIASES.get(t, t) for t in self.layer_types]
        if len(types) != n or set(types) - {LINEAR, INDEXED}:
            raise ValueError(f"layer_types: expected {n} entries of {LINEAR!r} or {INDEXED!r}, got {self.layer_types}")
        object.__setattr__(self, "layer_types", types)
        if self.mlp_layer_types is None:
            dense = min(3, n)
            object.__setattr__(self, "mlp_layer_types", ["dense"] * dense + ["sparse"] * (n - dense))
        if len(self.mlp_layer_types) != n or set(self.mlp_layer_types) - {"dense", "sparse"}:
            raise ValueError(f"mlp_layer_types: expected {n} entries of 'dense' or 'sparse', got {self.mlp_layer_types}")
        if "sparse" in self.mlp_layer_types and (self.n_routed_experts < 1 or self.n_routed_experts % self.n_group):
            raise ValueError(f"n_routed_experts: expected a positive multiple of n_group ({self.n_group}), got {self.n_routed_experts}")
        if self.indexer_types is None:
            object.__setattr__(self, "indexer_types", indexer_types_from(
                self.index_topk_pattern, self.index_topk_freq, self.index_skip_topk_offset, n))
        self._check_indexer()
        if self.hc_mult < 1 or self.hc_sinkhorn_iters < 1:
            raise ValueError(f"hc_mult / hc_sinkhorn_iters: expected ints >= 1, got {self.hc_mult} / {self.hc_sinkhorn_iters}")

    def _read_linear_attn_config(self) -> None:
        """``linear_attn_config`` (the released checkpoint's spelling) overrides the flat KDA keys."""
        linear = self.linear_attn_config
        if linear is None:
            return
        for field, key in (("linear_head_dim", "head_dim"), ("linear_num_heads", "num_heads"),
                           ("linear_conv_kernel_dim", "short_conv_kernel_size"), ("linear_lower_bound", "gate_lower_bound")):
            if key in linear:
                object.__setattr__(self, field, linear[key])
        if linear.get("safe_gate", True) and self.linear_lower_bound is None:
            object.__setattr__(self, "linear_lower_bound", -5.0)

    def _check_indexer(self) -> None:
        n, types = self.num_hidden_layers, self.indexer_types
        if len(types) != n or set(types) - {FULL, SHARED}:
            raise ValueError(f"indexer_types: expected {n} entries of 'full' or 'shared', got {types}")
        for i, layer_type in enumerate(self.layer_types):
            shared = layer_type == INDEXED and types[i] == SHARED
            if shared and (i == 0 or self.layer_types[i - 1] != INDEXED or types[i - 1] != FULL):
                raise ValueError(f"indexer_types: layer {i} is 'shared' but layer {i - 1} is not a 'full' indexed layer")
        if self.index_kpool < 1 or self.index_topk < self.index_kpool or self.index_topk % self.index_kpool:
            raise ValueError(f"index_topk: expected a positive multiple of index_kpool ({self.index_kpool}), got {self.index_topk}")
        if not self.index_kpool_always_select_tail:
            raise ValueError("index_kpool_always_select_tail: only true (the released checkpoint) is supported")


# -- mHC --------------------------------------------------------------------------------------


class HyperConnection(nn.Module):
    """mHC weights of one sublayer: ``forward(streams [T, N, D]) -> (post [T, N], comb [T, N, N],
    collapsed [T, D])`` (op ``mhc_sinkhorn``); `merge` forms the next streams.

    ``fn``, ``base`` and ``scale`` stay fp32 whatever the model dtype (transformers keeps them so).
    """

    def __init__(self, *, hc_mult: int, hidden_size: int, norm_eps: float, hc_eps: float, iters: int):
        super().__init__()
        width = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.zeros(width, hc_mult * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(width, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))
        self.norm_eps, self.hc_eps, self.iters = norm_eps, hc_eps, iters
        self._op = kernel("mhc_sinkhorn")

    def _apply(self, fn, recurse=True):
        super()._apply(fn, recurse)
        for p in self.parameters(recurse=False):
            if p.dtype != torch.float32:
                p.data = p.data.float()
        return self

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        flat = streams.reshape(streams.shape[0], -1).float()  # [T, N D]
        normed = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + self.norm_eps)  # unweighted RMSNorm
        return self._op(F.linear(normed, self.fn.float()), self.base, self.scale, streams, self.hc_eps, self.iters)

    @staticmethod
    def merge(out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """``post ⊗ out + combᵀ streams``: ``out [T, D]`` the sublayer's output → ``[T, N, D]``."""
        dtype = streams.dtype
        return post.to(dtype)[..., None] * out[:, None, :] + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)


# -- clamped SwiGLU -----------------------------------------------------------------------------


class ClampedMLP(GatedMLP):
    """GLM-5.3-Flash's dense MLP and shared expert: SwiGLU with the gate and up clamped."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float):
        super().__init__(hidden_size, intermediate_size)
        self.limit = limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            gate, up = self.gate_up(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(clamped_swiglu(gate, up, self.limit))


class ClampedMoE(GlmMoE):
    """GLM-5's router and shared expert layout, with clamped SwiGLU experts."""

    def __init__(self, config: Glm5NextConfig):
        super().__init__(config)
        limit, width = config.swiglu_limit, config.moe_intermediate_size
        # the core's grouped matmul with its clamp
        self.experts = StackedExperts(config.n_routed_experts, config.hidden_size, width, limit=limit)
        self.shared_experts = ClampedMLP(config.hidden_size, width * config.n_shared_experts, limit)


# -- decoder layers ------------------------------------------------------------------------------


class Glm5NextLayer(DecoderLayer):
    """A token mixer and an MLP, each inside an mHC: ``(streams [T, N, D], None) -> (streams, None)``."""

    def __init__(self, config: Glm5NextConfig, layer_index: int):
        super().__init__(layer_index)
        hc = dict(hc_mult=config.hc_mult, hidden_size=config.hidden_size, norm_eps=config.rms_norm_eps,
                  hc_eps=config.hc_eps, iters=config.hc_sinkhorn_iters)
        self.attn_hc, self.ffn_hc = HyperConnection(**hc), HyperConnection(**hc)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        limit = config.swiglu_limit
        sparse = config.mlp_layer_types[layer_index] == "sparse"
        self.mlp = ClampedMoE(config) if sparse else ClampedMLP(config.hidden_size, config.intermediate_size, limit)

    def mix(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        raise NotImplementedError

    def prefill(self, hidden, residual, ctx: ForwardContext):
        post, comb, x = self.attn_hc(hidden)
        streams = HyperConnection.merge(self.mix(self.input_layernorm(x), ctx), post, comb, hidden)
        return self.feed_forward(streams), None

    decode = prefill

    def feed_forward(self, streams: torch.Tensor) -> torch.Tensor:
        post, comb, x = self.ffn_hc(streams)
        return HyperConnection.merge(self.mlp(self.post_attention_layernorm(x)), post, comb, streams)


class Glm5NextKdaLayer(Glm5NextLayer):
    """KDA (lower-bounded gate) inside mHC; splits its prefill in the three gated-delta-rule phases."""

    layer_kind = GLM5_NEXT_KDA_KIND

    def __init__(self, config: Glm5NextConfig, layer_index: int):
        super().__init__(config, layer_index)
        self.self_attn = KimiDeltaAttention(
            layer_index=layer_index, hidden_size=config.hidden_size, num_heads=config.linear_num_heads,
            head_dim=config.linear_head_dim, conv_width=config.linear_conv_kernel_dim, norm_eps=config.rms_norm_eps,
            gate_lower_bound=config.linear_lower_bound, keep_fp32=True,
        )

    def state_spec(self, dtype: torch.dtype):
        return self.self_attn.state_spec(dtype)

    def mix(self, x, ctx):
        return self.self_attn(x, ctx)

    def prefill_phase1(self, hidden, residual, ctx):
        """``(recurrence, (normed input, streams, mHC weights))``."""
        post, comb, x = self.attn_hc(hidden)
        x = self.input_layernorm(x)
        return self.self_attn.phase1(x, ctx), (x, hidden, post, comb)

    def prefill_phase3(self, o, carry, ctx):
        x, streams, post, comb = carry
        return self.feed_forward(HyperConnection.merge(self.self_attn.output(o, x), post, comb, streams)), None


class KPoolDsaAttention(DsaMLAAttention):
    """GLM-5's DSA attention with the k-pool indexer's cache rows declared."""

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        spec = KVCacheSpec.latent(self.kv_lora_rank, self.rope_dim, dtype)
        if self.indexer is None:
            return spec
        return attrs.evolve(spec, extra_rows=self.indexer.extra_rows, pooled_rows=self.indexer.pooled_rows)


class Glm5NextDsaLayer(Glm5NextLayer):
    """NoPE MLA over the k-pool indexer's picks inside mHC."""

    layer_kind = GLM5_NEXT_DSA_KIND

    def __init__(self, config: Glm5NextConfig, layer_index: int, share_from: KPoolDsaAttention | None):
        super().__init__(config, layer_index)
        indexer = None
        if share_from is None:
            indexer = KPoolIndexer(
                layer_index=layer_index, hidden_size=config.hidden_size, q_lora_rank=config.q_lora_rank,
                num_heads=config.index_n_heads, head_dim=config.index_head_dim, index_topk=config.index_topk,
                kpool=config.index_kpool,
            )
        self.self_attn = KPoolDsaAttention(
            indexer=indexer, share_from=share_from, layer_index=layer_index, hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=0, v_head_dim=config.v_head_dim,
            norm_eps=config.rms_norm_eps, rotary=None, bias=config.attention_bias,
        )

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        return self.self_attn.kv_cache_spec(dtype)

    def mix(self, x, ctx):
        return self.self_attn(x, ctx)


class Glm5NextMtpBlock(PreNormDecoderLayer):
    """The MTP layer's block: k-pool DSA attention (own indexer) and the clamped MoE, plain pre-norm
    residuals (no mHC)."""

    layer_kind = GLM5_NEXT_DSA_KIND

    def __init__(self, config: Glm5NextConfig, layer_index: int):
        indexer = KPoolIndexer(
            layer_index=layer_index, hidden_size=config.hidden_size, q_lora_rank=config.q_lora_rank,
            num_heads=config.index_n_heads, head_dim=config.index_head_dim, index_topk=config.index_topk,
            kpool=config.index_kpool,
        )
        attn = KPoolDsaAttention(
            indexer=indexer, share_from=None, layer_index=layer_index, hidden_size=config.hidden_size,
            num_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
            qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=0, v_head_dim=config.v_head_dim,
            norm_eps=config.rms_norm_eps, rotary=None, bias=config.attention_bias,
        )
        super().__init__(layer_index, self_attn=attn, mlp=ClampedMoE(config), hidden_size=config.hidden_size,
                         eps=config.rms_norm_eps)


class Glm5NextForConditionalGeneration(CausalLM):
    """The text model: embedding copied into ``hc_mult`` streams → layers → stream mean → norm → head."""

    config_class = Glm5NextConfig

    def __init__(self, config: Glm5NextConfig, engine_config=None):
        super().__init__(config, engine_config)
        if self.mtp_requested():
            block = Glm5NextMtpBlock(config, config.num_hidden_layers)
            self.mtp = MtpHead(config.hidden_size, config.rms_norm_eps, block, mask_position0=True, carry_normed=True)

    def num_mtp_layers(self) -> int:
        return self.config.num_nextn_predict_layers

    def mtp_checkpoint_keys(self) -> list:
        # either prefix spelling (transformers saves the text model under model.language_model.)
        keys = nextn_head_keys(self.config.num_hidden_layers)
        return [(key, key.replace("model.", "model.language_model.", 1)) for key in keys]

    def build_layer(self, layer_index: int) -> DecoderLayer:
        c = self.config
        if c.layer_types[layer_index] == LINEAR:
            return Glm5NextKdaLayer(c, layer_index)
        share_from = None
        if c.indexer_types[layer_index] == SHARED:
            share_from = self.__dict__["_previous_layer"].self_attn  # the config checked it is a full indexed layer
        layer = Glm5NextDsaLayer(c, layer_index, share_from)
        self.__dict__["_previous_layer"] = layer  # plain attribute: IndexShare's source, not a submodule
        return layer

    def check_prompt(self, request_id: str, token_ids: list[int]) -> None:
        for key in ("image_token_id", "video_token_id"):
            token = getattr(self.config, key)
            if token is not None and token in token_ids:
                raise UserError(
                    f"request {request_id}: image and video inputs ({key} {token} in the prompt) are not supported: "
                    f"layerzoo serves the GLM-5.3-Flash text model only"
                )

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``input_ids [T]`` → final hidden states ``[T, hidden]`` through the mHC streams."""
        x = self.model.embed_tokens(input_ids)
        streams = x[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()  # [T, N, D]
        split = self._split_prefill_layers() if ctx.is_prefill else ()
        for i, layer in enumerate(self.layers):
            if i in split:  # phase 2 runs every prompt sequence in one varlen call
                streams, _ = three_phase_step(layer, streams, None, ctx, varlen=True)
            else:
                streams, _ = layer(streams, None, ctx)
        return self.model.norm(streams.mean(dim=1))


_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def name_map(config: Glm5NextConfig):
    """Checkpoint keys onto the model: ``model.language_model.`` (transformers' save) or
    ``model.`` prefixes; ``hc_attn_*`` / ``hc_ffn_*`` into the layers' `HyperConnection`; per-expert
    weights stacked; the vision tower, the MTP layer and ``shared_head`` skipped by name."""

    def mapped(key: str):
        if key.startswith(("model.visual.", "visual.", "mtp.")):
            return None
        if key.startswith("model.language_model."):
            key = "model." + key[len("model.language_model."):]
        layer = _LAYER.match(key)
        if layer is not None and int(layer.group(1)) >= config.num_hidden_layers:
            if int(layer.group(1)) > config.num_hidden_layers or ".hc_" in key:
                return None  # NextN layers past the first; the MTP layer's mHC (vLLM runs it without)
            key = nextn_target(key, config.num_hidden_layers)
            return None if key is None else stacked_expert_target(key, config.n_routed_experts) or key
        if ".shared_head." in key:
            return None
        key = key.replace(".hc_attn_", ".attn_hc.").replace(".hc_ffn_", ".ffn_hc.")
        key = key.replace(".self_attn.forget_gate.", ".self_attn.")
        return stacked_expert_target(key, config.n_routed_experts) or key

    return mapped
