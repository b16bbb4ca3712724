"""Multi-head latent attention (DeepSeek-V2/V3, Kimi, GLM-5) over a paged cache of latents.

Per token ``x [hidden]``::

    q          = q_proj(x)  or  q_b_proj(q_a_layernorm(q_a_proj(x)))     [H, dn + dr]
    c_kv, k_pe = kv_a_proj_with_mqa(x)                                 [kvr], [dr] (one head)
    c_kv       = kv_a_layernorm(c_kv)
    k_nope, v  = kv_b_proj(c_kv)                                       [H, dn], [H, dv]
    k          = [k_nope | k_pe]  (k_pe shared by every head),  q = [q_nope | q_pe]

with RoPE on ``q_pe`` and ``k_pe`` (none at all for NoPE models, GPT-J pairs for DeepSeek/GLM
checkpoints), softmax scale ``(dn + dr)^-0.5`` (times yarn's ``mscale²`` where the rope says so),
and an optional output gate ``o · σ(g_proj x)`` before ``o_proj`` (Kimi K3).

The paged cache keeps the latent row ``[c_kv | k_pe]`` of every token (`KVCacheSpec.latent`),
never the expanded K/V. Decode rows absorb ``W_UK`` into the query
(``q_lat[h] = W_UK[h]ᵀ q_nope[h]``) and attend over the latents as one shared KV "head" whose
values are the latents themselves; ``W_UV`` is applied after attention. Prefill rows expand
latents with ``kv_b_proj`` in one of two strategies:

- ``paged`` (default): the cached latents of the whole context (after writing the chunk's), so
  prefix hits, chunked prefill, forks and speculative verifies work;
- ``local``: only the chunk's own latents. Every prefill row must then start its sequence at
  position 0; the layer's plugin answers ``uses_local_mla_prefill`` True and the engine keeps it
  so (no prefix matching, no chunking, no forked tails, no verifies past position 0).

Tensor parallel: the query heads split across the ranks (``q_proj``/``q_b_proj``, ``kv_b_proj``
and ``g_proj`` column-parallel by head, ``o_proj`` row-parallel with an all-reduce); the latent
path (``q_a_proj``, ``kv_a_proj_with_mqa`` and their norms) is replicated, and so is the latent
cache: every rank keeps the same one-head rows (its spec does not shrink with the ranks).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from layerzoo.config import RopeConfig
from layerzoo.distributed import parallel_state
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.kv_cache import KVCacheSpec
from layerzoo.layers.norm import RMSNorm
from layerzoo.layers.parallel_linear import column_parallel_linear, local_heads, row_parallel_linear, split_heads
from layerzoo.plugins.ops import kernel

MLA_PREFILL_STRATEGIES = ("paged", "local")  # EngineArgs.mla_prefill


def yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_softmax_scale(qk_head_dim: int, rope: RopeConfig | None = None) -> float:
    """``qk_head_dim^-0.5``, times ``mscale(factor, mscale_all_dim)²`` under yarn with
    ``mscale_all_dim`` (DeepSeek-V3's rule: the long-context temperature goes into the scale)."""
    scale = qk_head_dim**-0.5
    if rope is not None and rope.rope_type == "yarn" and rope.mscale_all_dim and rope.factor:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale *= m * m
    return scale


class MLAAttention(nn.Module):
    """MLA with a latent cache; ``forward(x [T, hidden], ctx) -> [T, hidden]``.

    ``rotary`` is the model's `RotaryEmbedding` over ``qk_rope_head_dim`` (``ctx.cos_sin`` holds
    its cos/sin), or None for NoPE. Checkpoint names follow DeepSeek's (``q_a_proj``,
    ``q_a_layernorm``, ``q_b_proj`` or ``q_proj``, ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
    ``kv_b_proj``, ``o_proj``, and ``g_proj`` for the output gate).
    """

    def __init__(
        self,
        *,
        layer_index: int,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        norm_eps: float = 1e-6,
        rotary=None,
        interleaved_rope: bool = False,
        output_gate: bool = False,
        softmax_scale: float | None = None,
        prefill: str = "paged",
        bias: bool = False,
    ):
        super().__init__()
        assert prefill in MLA_PREFILL_STRATEGIES, prefill
        self.layer_index = layer_index
        self.num_heads, self.kv_lora_rank = local_heads(num_heads), kv_lora_rank  # this rank's heads
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.qk_dim = qk_nope_head_dim + qk_rope_head_dim
        self.scaling = softmax_scale if softmax_scale is not None else self.qk_dim**-0.5
        self.prefill = prefill
        self.q_lora_rank = q_lora_rank
        what = f"the MLA attention of layer {layer_index}"
        q_heads = split_heads(num_heads, self.qk_dim, what)
        if q_lora_rank is None:
            self.q_proj = column_parallel_linear(hidden_size, num_heads * self.qk_dim, shard=q_heads)
        else:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps)
            self.q_b_proj = column_parallel_linear(q_lora_rank, num_heads * self.qk_dim, shard=q_heads)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps)
        self.kv_b_proj = column_parallel_linear(
            kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim),
            shard=split_heads(num_heads, qk_nope_head_dim + v_head_dim, what),
        )
        v_heads = split_heads(num_heads, v_head_dim, what)
        self.o_proj = row_parallel_linear(num_heads * v_head_dim, hidden_size, bias, shard=v_heads)
        if output_gate:
            self.g_proj = column_parallel_linear(hidden_size, num_heads * v_head_dim, shard=v_heads)
        self.output_gate = output_gate
        self.__dict__["rotary"] = rotary  # shared with the model, not owned
        self.interleaved_rope = interleaved_rope
        self.fp8_kv = None  # set by the pool for an FP8 cache (answers fp8_calibration_frozen)
        self._rotate = kernel("rotary_embedding") if rotary is not None else None
        self._decode = kernel("paged_decode_attention")

    @property
    def fp8_calibration_frozen(self) -> bool | None:
        return None if self.fp8_kv is None else self.fp8_kv.calibration_frozen

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        return KVCacheSpec.latent(self.kv_lora_rank, self.rope_dim, dtype)

    # -- projections ---------------------------------------------------------------------------

    def _query(self, x: torch.Tensor) -> torch.Tensor:
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        return q.view(x.shape[0], self.num_heads, self.qk_dim)

    def _rope(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``x [T, h, dr]`` rotated (unchanged for NoPE)."""
        if self._rotate is None or self.rope_dim == 0:
            return x
        cos, sin = ctx.cos_sin
        return self._rotate(x.contiguous(), cos, sin, interleaved=self.interleaved_rope)

    def fuse_projections(self) -> None:
        """Called at load before CPU weight packing: keep a plain copy of ``kv_b_proj``'s weight for
        the absorbed decode (a packed weight cannot be viewed per head)."""
        self.__dict__["up_weight"] = self.kv_b_proj.weight.detach().clone()

    def _up_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``W_UK [H, dn, kvr]`` and ``W_UV [H, dv, kvr]`` (views of ``kv_b_proj``'s weight)."""
        weight = self.__dict__.get("up_weight", self.kv_b_proj.weight)
        w = weight.view(self.num_heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        return w[:, : self.nope_dim], w[:, self.nope_dim :]

    def _expand(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Latent rows ``[L, kvr + dr]`` → ``k [L, H, dn + dr]``, ``v [L, H, dv]``."""
        L = latent.shape[0]
        kv = self.kv_b_proj(latent[:, : self.kv_lora_rank]).view(L, self.num_heads, self.nope_dim + self.v_dim)
        k_nope, v = kv.split([self.nope_dim, self.v_dim], dim=-1)
        k_pe = latent[:, None, self.kv_lora_rank :].expand(L, self.num_heads, self.rope_dim)
        return torch.cat([k_nope, k_pe], dim=-1), v

    # -- the step ------------------------------------------------------------------------------

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        q = self._query(x)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe = self._rope(q_pe, ctx)
        k_pe = self._rope(k_pe[:, None, :], ctx)
        latent = torch.cat([self.kv_a_layernorm(c_kv)[:, None, :], k_pe], dim=-1)  # [T, 1, kvr + dr]
        ctx.kv_cache.write_latent(self.layer_index, latent, ctx)
        out = q.new_empty(T, self.num_heads, self.v_dim)
        nd = ctx.num_decodes
        if nd:
            out[:nd] = self._decode_absorbed(q_nope[:nd], q_pe[:nd], ctx)
        if nd < ctx.num_seqs:
            if self.prefill == "local":
                self._prefill_local(torch.cat([q_nope, q_pe], -1), latent[:, 0], ctx, out)
            else:
                self._prefill_paged(torch.cat([q_nope, q_pe], -1), ctx, out)
        if self.output_gate:
            out = out * torch.sigmoid(self.g_proj(x)).view(T, self.num_heads, self.v_dim)
        return parallel_state.all_reduce(self.o_proj(out.reshape(T, self.num_heads * self.v_dim)))

    def _decode_absorbed(self, q_nope, q_pe, ctx: ForwardContext) -> torch.Tensor:
        """One row per sequence over its cached latents: ``[nd, H, dn]``, ``[nd, H, dr]`` → ``[nd, H, dv]``."""
        nd = q_nope.shape[0]
        w_uk, w_uv = self._up_weights()
        q_lat = torch.einsum("bhd,hdk->bhk", q_nope, w_uk)
        cache, tables = ctx.kv_cache.latents(self.layer_index, ctx, q_nope.dtype)
        # Keys and values are the same latent rows: the scores read [c_kv | k_pe], the values c_kv.
        o_lat = self._decode(torch.cat([q_lat, q_pe], -1), cache, cache, tables[:nd], ctx.context_lens_tensor[:nd], self.scaling)
        return torch.einsum("bhk,hvk->bhv", o_lat[..., : self.kv_lora_rank], w_uv)

    def _prefill_paged(self, q: torch.Tensor, ctx: ForwardContext, out: torch.Tensor) -> None:
        """Each prefill sequence's rows over its whole cached context, expanded."""
        cache, tables = ctx.kv_cache.latents(self.layer_index, ctx, q.dtype)
        block_size = cache.shape[1]
        starts = ctx.query_start_tensor().tolist()
        for b in range(ctx.num_decodes, ctx.num_seqs):
            length, rows = ctx.context_lens[b], slice(starts[b], starts[b + 1])
            blocks = tables[b, : -(-length // block_size)]
            latent = cache.index_select(0, blocks).reshape(-1, cache.shape[-1])[:length]
            out[rows] = self._attend(q[rows], latent, length - ctx.query_lens[b])

    def _prefill_local(self, q: torch.Tensor, latent: torch.Tensor, ctx: ForwardContext, out: torch.Tensor) -> None:
        """Each prefill sequence's rows over its own rows only: the chunk must start the sequence."""
        starts = ctx.query_start_tensor().tolist()
        for b in range(ctx.num_decodes, ctx.num_seqs):
            assert ctx.context_lens[b] == ctx.query_lens[b], (
                f"MLA layer {self.layer_index}: a chunk-local prefill row starts at position "
                f"{ctx.context_lens[b] - ctx.query_lens[b]}, not 0 (the engine's gating let it through)"
            )
            rows = slice(starts[b], starts[b + 1])
            out[rows] = self._attend(q[rows], latent[rows], 0)

    def _attend(self, q: torch.Tensor, latent: torch.Tensor, offset: int) -> torch.Tensor:
        """``q [n, H, dn + dr]`` at positions ``offset..offset+n-1`` over ``latent [L, kvr + dr]``
        (positions ``0..L-1``), causal → ``[n, H, dv]``."""
        k, v = self._expand(latent)
        n, L = q.shape[0], latent.shape[0]
        visible = torch.arange(L, device=q.device)[None, :] <= torch.arange(offset, offset + n, device=q.device)[:, None]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=visible, scale=self.scaling
        )
        return o.transpose(0, 1)
