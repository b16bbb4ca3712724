"""MLA restricted to the tokens the DSA indexer selects (GLM-5's ``indexed_attention``).

The core's `MLAAttention` does the projections, RoPE and the latent cache; this layer adds the
indexer (or, for an IndexShare "shared" layer, the previous full layer's selection) and attends
each query only over its selected, causally visible tokens:

- decode rows, batched: the selected latents are gathered from the pool (``[nd, k, kvr + dr]``)
  and attended with ``W_UK`` absorbed into the query, as the core's MLA decode does;
- prefill rows, per sequence: the context's latents are expanded and attended under the mask
  ``causal ∧ selected``.

Tensor parallel: the MLA heads split as in the core; the indexer is replicated (every rank selects
the same tokens from the same inputs, and keeps the same indexer-key rows in its cache).
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from layerzoo.distributed import parallel_state
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.kv_cache import KVCacheSpec
from layerzoo.layers.mla import MLAAttention
from layerzoo_glm53.indexer import INDEX_ROW, LightningIndexer, Selection


class DsaMLAAttention(MLAAttention):
    """``forward(x [T, hidden], ctx) -> [T, hidden]``.

    ``indexer`` is this layer's `LightningIndexer`, or None for a shared layer, which then reads
    ``share_from.selection`` (the previous full layer, run earlier in the same step).
    """

    def __init__(self, *, indexer: LightningIndexer | None, share_from: DsaMLAAttention | None = None, **mla):
        super().__init__(**mla)
        assert self.q_lora_rank is not None, "the DSA indexer reads the q_lora residual"
        assert (indexer is None) != (share_from is None), "a DSA layer has an indexer or shares one"
        self.indexer = indexer
        self.__dict__["share_from"] = share_from  # not a submodule: its weights are its own layer's
        self.selection: Selection | None = None

    def kv_cache_spec(self, dtype: torch.dtype) -> KVCacheSpec:
        spec = super().kv_cache_spec(dtype)
        if self.indexer is None:
            return spec
        return attrs.evolve(spec, extra_rows=((INDEX_ROW, self.indexer.head_dim),))

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        T = x.shape[0]
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(T, self.num_heads, self.qk_dim)
        q_nope, q_pe = q.split([self.nope_dim, self.rope_dim], dim=-1)
        c_kv, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        q_pe = self._rope(q_pe, ctx)
        k_pe = self._rope(k_pe[:, None, :], ctx)
        latent = torch.cat([self.kv_a_layernorm(c_kv)[:, None, :], k_pe], dim=-1)  # [T, 1, kvr + dr]
        ctx.kv_cache.write_latent(self.layer_index, latent, ctx)
        if self.indexer is not None:
            self.selection = self.indexer.select(x, q_resid, ctx)
        else:
            self.selection = self.share_from.selection
        out = q.new_empty(T, self.num_heads, self.v_dim)
        nd = ctx.num_decodes
        if nd:
            out[:nd] = self._decode_selected(q_nope[:nd], q_pe[:nd], self.selection.decode, ctx)
        if nd < ctx.num_seqs:
            self._prefill_selected(torch.cat([q_nope, q_pe], -1), self.selection.prefill, ctx, out)
        return parallel_state.all_reduce(self.o_proj(out.reshape(T, self.num_heads * self.v_dim)))

    def _decode_selected(self, q_nope, q_pe, picks: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``[nd, H, dn]``, ``[nd, H, dr]``, ``picks [nd, k]`` positions → ``[nd, H, dv]``."""
        nd = q_nope.shape[0]
        w_uk, w_uv = self._up_weights()
        q_lat = torch.cat([torch.einsum("bhd,hdk->bhk", q_nope, w_uk), q_pe], dim=-1)  # [nd, H, kvr + dr]
        cache, tables = ctx.kv_cache.latents(self.layer_index, ctx, q_nope.dtype)
        block_size = cache.shape[1]
        # Picks past a sequence's length (rows seeing fewer than index_topk keys) are masked below;
        # clamped, they stay inside the table (an FP8 cache's compact table is narrower).
        inside = picks.clamp(max=tables.shape[1] * block_size - 1)
        slots = tables[:nd].gather(1, inside // block_size) * block_size + inside % block_size  # [nd, k]
        latents = cache.view(-1, cache.shape[-1])[slots]  # [nd, k, kvr + dr]
        scores = torch.einsum("bhc,bkc->bhk", q_lat, latents).float() * self.scaling
        visible = picks < ctx.context_lens_tensor[:nd, None]
        probs = scores.masked_fill(~visible[:, None, :], float("-inf")).softmax(-1).to(q_nope.dtype)
        o_lat = torch.einsum("bhk,bkc->bhc", probs, latents[..., : self.kv_lora_rank])
        return torch.einsum("bhk,hvk->bhv", o_lat, w_uv)

    def _prefill_selected(self, q: torch.Tensor, picks: dict[int, torch.Tensor], ctx: ForwardContext, out: torch.Tensor) -> None:
        """Each prefill sequence's rows over its cached context, restricted to its picks."""
        cache, tables = ctx.kv_cache.latents(self.layer_index, ctx, q.dtype)
        block_size = cache.shape[1]
        starts = ctx.query_start_tensor().tolist()
        for b in range(ctx.num_decodes, ctx.num_seqs):
            length, rows = ctx.context_lens[b], slice(starts[b], starts[b + 1])
            blocks = tables[b, : -(-length // block_size)]
            latent = cache.index_select(0, blocks).reshape(-1, cache.shape[-1])[:length]
            out[rows] = self._attend_selected(q[rows], latent, length - ctx.query_lens[b], picks[b])

    def _attend_selected(self, q: torch.Tensor, latent: torch.Tensor, offset: int, picks: torch.Tensor) -> torch.Tensor:
        """``q [n, H, dn + dr]`` at positions ``offset..`` over ``latent [L, kvr + dr]``, each row
        only over its ``picks [n, k]`` that are visible → ``[n, H, dv]`` (picks ``>= L`` select
        nothing: the k-pool indexer's empty slots)."""
        k, v = self._expand(latent)
        n, L = q.shape[0], latent.shape[0]
        causal = torch.arange(L, device=q.device)[None, :] <= torch.arange(offset, offset + n, device=q.device)[:, None]
        selected = torch.zeros(n, L + 1, dtype=torch.bool, device=q.device).scatter_(1, picks.clamp(max=L), True)[:, :L]
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=causal & selected, scale=self.scaling
        )
        return o.transpose(0, 1)
