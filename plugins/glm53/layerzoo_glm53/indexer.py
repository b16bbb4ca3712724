"""The DSA lightning indexer (DeepSeek-V3.2, GLM-5): which cached tokens each query attends to.

Per token ``x [hidden]`` with the MLA query residual ``q_resid = q_a_layernorm(q_a_proj(x))``::

    q   = wq_b(q_resid)                      [Hi, Di]   RoPE on the first rope dims of each head
    key = LayerNorm(wk(x))                   [Di]       one head, RoPE on the first rope dims
    w   = weights_proj(x) · Hi^-0.5          [Hi]       fp32
    score[j] = Σ_h w[h] · relu(Di^-0.5 · q[h] · key[j])   over the visible keys j <= position

and the query keeps the ``min(index_topk, visible)`` keys of highest score (op
``dsa_indexer_topk``). The keys live in the paged pool as an extra per-token row of the layer
(``INDEX_ROW``, `KVCacheSpec.extra_rows`) next to the MLA latent, under the same block tables:
prefix hits, chunked prefill, preemption and verifies see them exactly as they see the latents.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from layerzoo.layers.context import ForwardContext
from layerzoo.plugins.ops import kernel

INDEX_ROW = "index_k"  # the extra per-token cache row holding the indexer key


class Selection(NamedTuple):
    """One step's top-k of one indexer layer (read again by the IndexShare layers after it).

    ``decode``: ``[nd, k]`` positions for the step's decode rows (None without any); ``prefill``:
    for each prefill sequence ``b``, ``[n_b, k_b]`` positions for its rows. (A named tuple, not
    an attrs class: a compiled decode step traces it.)
    """

    decode: torch.Tensor | None
    prefill: dict[int, torch.Tensor]


class LightningIndexer(nn.Module):
    """``select(x [T, hidden], q_resid [T, q_lora_rank], ctx) -> Selection``; writes the step's keys."""

    def __init__(
        self,
        *,
        layer_index: int,
        hidden_size: int,
        q_lora_rank: int,
        num_heads: int,
        head_dim: int,
        index_topk: int,
        interleaved_rope: bool = True,
    ):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads, self.head_dim, self.index_topk = num_heads, head_dim, index_topk
        self.interleaved_rope = interleaved_rope
        self.softmax_scale = head_dim**-0.5
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, num_heads, bias=False)
        self._rotate = kernel("rotary_embedding")
        self._topk = kernel("dsa_indexer_topk")

    def _rope(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """``x [T, h, Di]`` rotated on its first rope dims (``ctx.cos_sin`` is over those)."""
        cos, sin = ctx.cos_sin
        return self._rotate(x.contiguous(), cos, sin, interleaved=self.interleaved_rope)

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, ctx: ForwardContext) -> Selection:
        T = x.shape[0]
        q = self._rope(self.wq_b(q_resid).view(T, self.num_heads, self.head_dim), ctx)
        key = self._rope(self.k_norm(self.wk(x))[:, None, :], ctx)  # [T, 1, Di]
        weights = self.weights_proj(x).float() * self.num_heads**-0.5  # [T, Hi]
        ctx.kv_cache.write_row(self.layer_index, INDEX_ROW, key, ctx)
        cache = ctx.kv_cache.row(self.layer_index, INDEX_ROW)  # [N, bs, 1, Di]
        block_size = cache.shape[1]
        nd = ctx.num_decodes
        decode = None
        if nd:
            # Batched on the device, no host values: every decode row scores its table's width of
            # keys; padding past a sequence's length sits after its position, so is never visible.
            keys = cache[ctx.block_tables[:nd]].reshape(nd, -1, self.head_dim)
            top = min(self.index_topk, keys.shape[1])
            decode = self._topk(q[:nd, None], weights[:nd, None], keys, ctx.positions[:nd, None], top, self.softmax_scale)[:, 0]
        prefill = {}
        if nd == ctx.num_seqs:  # decode only: no host values read (the step may be a captured graph)
            return Selection(decode, prefill)
        starts = ctx.query_start_tensor().tolist()
        for b in range(nd, ctx.num_seqs):
            length, rows = ctx.context_lens[b], slice(starts[b], starts[b + 1])
            blocks = ctx.block_tables[b, : -(-length // block_size)]
            keys = cache.index_select(0, blocks).reshape(-1, self.head_dim)[:length]
            top = min(self.index_topk, length)
            prefill[b] = self._topk(q[None, rows], weights[None, rows], keys[None], ctx.positions[None, rows], top, self.softmax_scale)[0]
        return Selection(decode, prefill)
