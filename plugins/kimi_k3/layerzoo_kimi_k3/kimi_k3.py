"""The Kimi K3 text model (``KimiK3ForConditionalGeneration``, its ``text_config``).

What K3 adds to Kimi Linear (facts: ``kimi-k3-facts.md``, transcribed from vLLM's and SGLang's
K3 code):

- KDA with the lower-bounded gate ``g = -5 · σ(exp(A_log[h]) · (f + dt_bias))`` and a full-rank
  output gate ``g_proj``. ``A_log`` is stored with more entries than heads (``[128]`` for 96 heads,
  padded to head_dim); every engine reads it per head, the first ``H`` entries.
- Gated NoPE MLA with ``q_lora``: ``o · σ(g_proj x)`` before ``o_proj``.
- SiTU-GLU everywhere: ``β tanh(g/β) σ(g) · βₗ tanh(u/βₗ)`` in fp32 (β 4, βₗ 25).
- Latent MoE: router and shared experts on the full-width x; routed experts run in the latent
  width after ``routed_expert_down_proj``, their weighted sum is RMS-normed and projected back up.
- AttnRes instead of residual adds: each sublayer's input is a softmax over depth of the banked
  block summaries and the running partial sum (`attn_res`); every ``attn_res_block_size`` layers
  the partial sum is banked and restarts; a final mix runs before the last norm.

Image inputs are refused (the vision tower is not served). Routed experts stored as MXFP4
(compressed-tensors, groups of 32) stay in their codes and scales (uint8, 0.53 bytes a weight) and
run through the ``mxfp4_expert_matmul`` kernels (`layerzoo.kernels.mxfp4_matmul`); any other
``quantization_config`` is refused naming it.
"""

from __future__ import annotations

import re

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from layerzoo.config import hf
from layerzoo.distributed import parallel_state
from layerzoo.distributed.sharding import set_shard
from layerzoo.errors import UserError
from layerzoo.layers.base import DecoderLayer
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.kda import KimiDeltaAttention
from layerzoo.layers.mla import MLAAttention
from layerzoo.layers.model import CausalLM
from layerzoo.layers.norm import RMSNorm
from layerzoo.layers.parallel_linear import column_parallel_linear, row_parallel_linear, split_rows
from layerzoo.loading.loader import Target
from layerzoo.plugins.ops import kernel
from layerzoo_kimi_k3 import KDA_KIND, MLA_KIND, mxfp4
from layerzoo_kimi_k3.kimi_linear import FULL, MLA_NORM_EPS, KimiLinearConfig, sigmoid_router
from layerzoo_kimi_k3.kimi_linear import name_map as kimi_linear_name_map


@attrs.frozen(kw_only=True)
class KimiK3Config(KimiLinearConfig):
    hidden_act: str = hf("situ", kind=str)
    activation_situ_beta: float = hf(1.0, kind=float)
    activation_situ_linear_beta: float | None = hf(None, kind=float)
    routed_expert_hidden_size: int = hf(kind=int)
    latent_moe_use_norm: bool = hf(True, kind=bool)
    mla_use_output_gate: bool = hf(False, kind=bool)
    attn_res_block_size: int = hf(kind=int)
    media_placeholder_token_id: int | None = hf(None, kind=int)
    quantization_config: dict | None = hf(None, kind=dict)

    def __attrs_post_init__(self):
        super().__attrs_post_init__()
        if self.quantization_config is not None:
            mxfp4.check_quantization_config(self.quantization_config)
        if not self.latent_moe_use_norm:
            raise ValueError("latent_moe_use_norm: only true (the released K3) is supported")
        if self.attn_res_block_size < 1:
            raise ValueError(f"attn_res_block_size: expected an int >= 1, got {self.attn_res_block_size}")

    def check_activation(self) -> None:
        if self.hidden_act != "situ":
            raise ValueError(f"hidden_act: expected 'situ' (K3's SiTU-GLU), got {self.hidden_act!r}")

    @property
    def mxfp4(self) -> bool:
        """Routed experts stored as MXFP4 (compressed-tensors); everything else is unquantised."""
        return self.quantization_config is not None

    @property
    def gate_lower_bound(self) -> float | None:
        return self.linear_attn_config.get("gate_lower_bound")


def situ_and_mul(gate: torch.Tensor, up: torch.Tensor, beta: float, linear_beta: float | None) -> torch.Tensor:
    """``β tanh(g/β) σ(g) · βₗ tanh(u/βₗ)`` in fp32 (no clamp of ``u`` when ``linear_beta`` is None)."""
    g, u = gate.float(), up.float()
    a = beta * torch.tanh(g / beta) * torch.sigmoid(g)
    if linear_beta is not None:
        u = linear_beta * torch.tanh(u / linear_beta)
    return (a * u).to(gate.dtype)


class SituMLP(nn.Module):
    """The SiTU-GLU MLP; tensor parallel: gate/up column-parallel, down row-parallel, all-reduced."""

    def __init__(self, hidden: int, intermediate: int, config: KimiK3Config):
        super().__init__()
        inner = split_rows(intermediate, "the SiTU MLP's intermediate size")
        self.gate_proj = column_parallel_linear(hidden, intermediate, shard=inner)
        self.up_proj = column_parallel_linear(hidden, intermediate, shard=inner)
        self.down_proj = row_parallel_linear(intermediate, hidden, shard=inner)
        self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(situ_and_mul(self.gate_proj(x), self.up_proj(x), self.beta, self.linear_beta))
        return parallel_state.all_reduce(out)


class SituExperts(nn.Module):
    """Stacked SiTU experts in the latent width: ``gate_up_proj [E, 2I, L]``, ``down_proj [E, L, I]``.

    From an MXFP4 checkpoint the experts keep the checkpoint's codes and scales instead (uint8:
    ``gate_up_packed [E, 2, I, L/2]``, ``gate_up_scale [E, 2, I, L/32]``, ``down_packed [E, L,
    I/2]``, ``down_scale [E, L, I/32]``) and `forward` multiplies them as they are
    (``mxfp4_expert_matmul``: C++ on CPU, Triton on CUDA, torch elsewhere), in fp32, rounded to
    the activations' dtype between the projections as the dense path rounds.

    Tensor parallel: this rank holds experts ``[first_expert, first_expert + E / N)`` (codes or
    weights) and `forward` returns their share of the sum, which the owner all-reduces.
    """

    def __init__(self, config: KimiK3Config):
        super().__init__()
        shard = split_rows(config.num_experts, "the routed experts")
        E, L, I = config.num_experts if shard is None else shard.local_size, config.routed_expert_hidden_size, config.moe_intermediate_size
        self.first_expert = 0 if shard is None else shard.ranges()[0][0]
        self.num_local = E
        self.beta, self.linear_beta = config.activation_situ_beta, config.activation_situ_linear_beta
        self.mxfp4 = config.mxfp4
        if not config.mxfp4:
            self.gate_up_proj = nn.Parameter(torch.empty(E, 2 * I, L))
            self.down_proj = nn.Parameter(torch.empty(E, L, I))
            self._split(shard, "gate_up_proj", "down_proj")
            return
        if L % mxfp4.GROUP or I % mxfp4.GROUP:
            raise ValueError(f"MXFP4 experts need routed_expert_hidden_size ({L}) and moe_intermediate_size ({I}) in multiples of 32")
        packed = lambda *shape: nn.Parameter(torch.zeros(*shape, dtype=torch.uint8), requires_grad=False)  # noqa: E731
        self.gate_up_packed, self.gate_up_scale = packed(E, 2, I, L // 2), packed(E, 2, I, L // mxfp4.GROUP)
        self.down_packed, self.down_scale = packed(E, L, I // 2), packed(E, L, I // mxfp4.GROUP)
        self._split(shard, "gate_up_packed", "gate_up_scale", "down_packed", "down_scale")
        self._expert_matmul = kernel("mxfp4_expert_matmul")

    def _split(self, shard, *names: str) -> None:
        for name in names:
            set_shard(self, name, shard)

    def forward(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``z [T, L]``, ``weights, ids [T, k]`` → ``Σ_j w_j · expert_j(z)`` ``[T, L]`` (fp32 sum)."""
        if self.mxfp4:
            return self._packed_forward(z, weights, ids)
        out = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32, device=z.device)
        for expert in ids.unique().tolist():
            local = expert - self.first_expert
            if not 0 <= local < self.num_local:
                continue  # another rank's expert
            rows, slot = (ids == expert).nonzero(as_tuple=True)
            gate, up = F.linear(z[rows], self.gate_up_proj[local]).chunk(2, dim=-1)
            y = F.linear(situ_and_mul(gate, up, self.beta, self.linear_beta), self.down_proj[local])
            out.index_add_(0, rows, y.float() * weights[rows, slot, None].float())
        return out.to(z.dtype)

    def _packed_forward(self, z: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """The MXFP4 experts: each (token, slot) pair routed to this rank's experts is a row of the
        expert matmul (the kernels group the rows by expert)."""
        local = ids - self.first_expert
        tokens, slots = ((local >= 0) & (local < self.num_local)).nonzero(as_tuple=True)
        out = torch.zeros(z.shape[0], z.shape[1], dtype=torch.float32, device=z.device)
        if tokens.numel() == 0:
            return out.to(z.dtype)
        experts = local[tokens, slots]
        E, _, I, half = self.gate_up_packed.shape
        gate_up = self._expert_matmul(z.index_select(0, tokens), experts, self.gate_up_packed.view(E, 2 * I, half),
                                      self.gate_up_scale.view(E, 2 * I, -1))
        gate, up = gate_up.to(z.dtype).chunk(2, dim=-1)
        h = situ_and_mul(gate, up, self.beta, self.linear_beta)
        y = self._expert_matmul(h, experts, self.down_packed, self.down_scale).to(z.dtype)
        out.index_add_(0, tokens, y.float() * weights[tokens, slots, None].float())
        return out.to(z.dtype)


class LatentMoE(nn.Module):
    """Routed experts in the latent width (down-projected, normed after the sum, up-projected) plus
    full-width shared experts. Tensor parallel: the latent projections and the norm are replicated;
    the routed partial sums are all-reduced before the norm (which needs the whole sum)."""

    def __init__(self, config: KimiK3Config):
        super().__init__()
        hidden, latent = config.hidden_size, config.routed_expert_hidden_size
        self.gate = sigmoid_router(config)
        self.routed_expert_down_proj = nn.Linear(hidden, latent, bias=False)
        self.routed_expert_norm = RMSNorm(latent, config.rms_norm_eps)
        self.routed_expert_up_proj = nn.Linear(latent, hidden, bias=False)
        self.experts = SituExperts(config)
        self.shared_experts = SituMLP(hidden, config.moe_intermediate_size * config.num_shared_experts, config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.gate(x)
        y = parallel_state.all_reduce(self.experts(self.routed_expert_down_proj(x), weights, ids))
        return self.routed_expert_up_proj(self.routed_expert_norm(y)) + self.shared_experts(x)


def attn_res(bank: list[torch.Tensor], prefix: torch.Tensor, norm_w: torch.Tensor, proj_w: torch.Tensor, eps: float) -> torch.Tensor:
    """Softmax over depth: ``Σ_j p_j V_j`` with ``V = [*bank, prefix]`` (each ``[T, D]``) and scores
    ``rmsnorm(V_j) · (norm_w ⊙ proj_w)``, all fp32; returns ``[T, D]`` in the prefix's dtype."""
    values = torch.stack([*bank, prefix], dim=1).float()  # [T, n, D]
    normed = values * torch.rsqrt(values.pow(2).mean(-1, keepdim=True) + eps)
    scores = normed @ (norm_w.float() * proj_w.float().view(-1))  # [T, n]
    return (scores.softmax(-1)[..., None] * values).sum(1).to(prefix.dtype)


class ResProj(nn.Module):
    """An AttnRes pseudo-query ``weight [1, D]`` (a parameter, not a linear: it only scales scores)."""

    def __init__(self, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(1, hidden))


class K3DecoderLayer(DecoderLayer):
    """A KDA or gated-MLA mixer and a dense or latent-MoE SiTU MLP; the model mixes their inputs
    with AttnRes (the layer has no residual stream of its own). Tensor parallel: the mixer and
    the MLPs split (the core's MLA and KDA, `SituMLP`, `LatentMoE`); AttnRes runs replicated on the
    whole hidden states every rank holds."""

    tensor_parallel = True

    def __init__(self, config: KimiK3Config, layer_index: int, prefill: str):
        super().__init__(layer_index)
        hidden = config.hidden_size
        if config.layer_types[layer_index] == FULL:
            self.self_attn = MLAAttention(
                layer_index=layer_index, hidden_size=hidden, num_heads=config.num_attention_heads,
                q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank,
                qk_nope_head_dim=config.qk_nope_head_dim, qk_rope_head_dim=config.qk_rope_head_dim,
                v_head_dim=config.v_head_dim, norm_eps=MLA_NORM_EPS, rotary=None,
                output_gate=config.mla_use_output_gate, prefill=prefill, bias=config.attention_bias,
            )
        else:
            heads, dim = config.kda_heads, config.kda_head_dim
            self.self_attn = KimiDeltaAttention(
                layer_index=layer_index, hidden_size=hidden, num_heads=heads, head_dim=dim,
                conv_width=config.conv_width, norm_eps=config.rms_norm_eps, gate_lower_bound=config.gate_lower_bound,
                full_rank_output_gate=bool(config.linear_attn_config.get("use_full_rank_gate", False)),
                a_log_shape=(max(heads, dim),),
            )
        if config.mlp_layer_types[layer_index] == "sparse":
            self.mlp = LatentMoE(config)
        else:
            self.mlp = SituMLP(hidden, config.intermediate_size, config)
        self.input_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(hidden, config.rms_norm_eps)
        self.self_attention_res_norm, self.self_attention_res_proj = RMSNorm(hidden), ResProj(hidden)
        self.mlp_res_norm, self.mlp_res_proj = RMSNorm(hidden), ResProj(hidden)
        self.eps = config.rms_norm_eps

    @property
    def layer_kind(self) -> str:  # type: ignore[override]
        return MLA_KIND if isinstance(self.self_attn, MLAAttention) else KDA_KIND

    def kv_cache_spec(self, dtype: torch.dtype):
        return self.self_attn.kv_cache_spec(dtype) if isinstance(self.self_attn, MLAAttention) else None

    def state_spec(self, dtype: torch.dtype):
        return self.self_attn.state_spec(dtype) if isinstance(self.self_attn, KimiDeltaAttention) else None

    def mix(self, x: torch.Tensor, ctx: ForwardContext, varlen: bool = False) -> torch.Tensor:
        """The token mixer over the normed input ``x [T, D]`` (``varlen``: a KDA layer on the split
        route, its prompt sequences in one recurrence call)."""
        attn = self.self_attn
        if isinstance(attn, MLAAttention):
            return attn(x, ctx)
        return attn(x, ctx, varlen)

    # The three phases are the mixer's; the model runs them inside `step`, since AttnRes needs
    # the whole step's inputs of one layer before the next.
    def prefill_phase1(self, hidden, residual, ctx):
        return self.self_attn.phase1(hidden, ctx), hidden

    def prefill_phase3(self, o, x, ctx):
        return self.self_attn.output(o, x), None

    def step(self, bank: list[torch.Tensor], prefix: torch.Tensor, ctx: ForwardContext, block_size: int, split: bool = False):
        """One layer of the AttnRes stream; returns the new ``(bank, prefix)``. ``split``: the layer
        prefills on the split route (it answered ``is_ssm_layer``)."""
        h = prefix if not bank else attn_res(bank, prefix, self.self_attention_res_norm.weight, self.self_attention_res_proj.weight, self.eps)
        if self.layer_index % block_size == 0:
            bank, prefix = [*bank, prefix], None
        a = self.mix(self.input_layernorm(h), ctx, varlen=split)
        prefix = a if prefix is None else prefix + a
        h = attn_res(bank, prefix, self.mlp_res_norm.weight, self.mlp_res_proj.weight, self.eps)
        return bank, prefix + self.mlp(self.post_attention_layernorm(h))


class KimiK3ForCausalLM(CausalLM):
    config_class = KimiK3Config

    def __init__(self, config: KimiK3Config, engine_config=None):
        super().__init__(config, engine_config)
        self.model.output_attn_res_norm = RMSNorm(config.hidden_size)
        self.model.output_attn_res_proj = ResProj(config.hidden_size)

    def build_layer(self, layer_index: int) -> DecoderLayer:
        return K3DecoderLayer(self.config, layer_index, self.engine_config.mla_prefill)

    def check_prompt(self, request_id: str, token_ids: list[int]) -> None:
        media = self.config.media_placeholder_token_id
        if media is not None and media in token_ids:
            raise UserError(
                f"request {request_id}: image inputs (media_placeholder_token_id {media}) are not supported: "
                f"layerzoo serves the Kimi K3 text model only"
            )

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``input_ids [T]`` → final hidden states ``[T, hidden]``, through the AttnRes stream."""
        bank: list[torch.Tensor] = []
        prefix = self.model.embed_tokens(input_ids)
        split = self._split_prefill_layers() if ctx.is_prefill else ()
        for i, layer in enumerate(self.layers):
            bank, prefix = layer.step(bank, prefix, ctx, self.config.attn_res_block_size, i in split)
        m = self.model
        h = attn_res(bank, prefix, m.output_attn_res_norm.weight, m.output_attn_res_proj.weight, self.config.rms_norm_eps)
        return m.norm(h)


class KimiK3ForConditionalGeneration(KimiK3ForCausalLM):
    """The multimodal wrapper's name; its text model is served (``text_config``)."""


_MXFP4_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(w1|w2|w3)\.weight_(packed|scale)$")


def name_map(config: KimiK3Config):
    """``language_model.`` stripped (both ``language_model.model.layers`` and
    ``language_model.layers``), the vision tower and projector skipped, experts stacked (MXFP4
    ``weight_packed`` / ``weight_scale`` into the codes `SituExperts` multiplies)."""
    inner = kimi_linear_name_map(config)
    E = config.num_experts

    def mapped(key: str):
        if key.startswith(("vision_tower.", "mm_projector.")):
            return None
        if key.startswith("language_model."):
            key = key[len("language_model."):]
            if key.startswith("layers."):
                key = "model." + key
        match = _MXFP4_EXPERT.match(key.replace(".block_sparse_moe.", ".mlp."))
        if match is not None and config.mxfp4:
            prefix, expert, w, part = match.group(1), int(match.group(2)), match.group(3), match.group(4)
            if w == "w2":
                return Target(f"{prefix}.down_{part}", (expert,), (E,))
            return Target(f"{prefix}.gate_up_{part}", (expert, 0 if w == "w1" else 1), (E, 2))
        return inner(key)

    return mapped
