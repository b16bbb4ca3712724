"""The paged KV pool: per-layer K/V storage in fixed-size blocks, and attention over it.

Every attention layer owns ``k, v [num_blocks, block_size, Hkv, D]``. A token at position ``p`` of
a sequence lives in block ``block_table[p // block_size]`` at offset ``p % block_size``; the step's
``slot_mapping [T]`` holds ``block * block_size + offset`` for each new token. Block ids come from
the device-free `BlockManager`; this module only stores and reads.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F

from layerzoo.context import ForwardContext
from layerzoo.kv_cache import KVCacheSpec


def num_blocks_for_budget(specs: Mapping[int, KVCacheSpec], block_size: int, budget_bytes: int) -> int:
    """How many blocks fit in ``budget_bytes`` given every layer's per-token footprint."""
    per_block = block_size * sum(spec.bytes_per_token for spec in specs.values())
    return max(0, budget_bytes // per_block) if per_block else 0


class PagedKVCache:
    """K/V blocks for every attention layer; ``attend`` writes a step's K/V and attends over it."""

    def __init__(self, specs: Mapping[int, KVCacheSpec], num_blocks: int, block_size: int, device="cpu"):
        assert num_blocks > 0 and block_size > 0
        self.specs = dict(specs)
        self.num_blocks, self.block_size, self.device = num_blocks, block_size, torch.device(device)
        self.k = {
            i: torch.zeros(num_blocks, block_size, s.num_kv_heads, s.head_dim, dtype=s.dtype, device=device)
            for i, s in self.specs.items()
        }
        self.v = {i: torch.zeros_like(t) for i, t in self.k.items()}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k.values(), *self.v.values()))

    def attend(self, layer: int, q, k, v, scaling: float, ctx: ForwardContext) -> torch.Tensor:
        """Write the step's K/V of ``layer`` into its slots, then attend causally.

        Args:
            q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` (rotated), rows ordered as ``ctx``:
               the ``ctx.num_decodes`` one-token decode rows first, then prefill chunks.
        Returns:
            ``[T, Hq, D]``.
        """
        k_cache, v_cache = self.k[layer], self.v[layer]
        flat_k = k_cache.view(-1, *k_cache.shape[2:])
        flat_v = v_cache.view(-1, *v_cache.shape[2:])
        flat_k.index_copy_(0, ctx.slot_mapping, k.to(k_cache.dtype))
        flat_v.index_copy_(0, ctx.slot_mapping, v.to(v_cache.dtype))
        nd = ctx.num_decodes
        if nd == ctx.num_seqs:
            return self._decode(layer, q, ctx, nd, scaling)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode(layer, q[:nd], ctx, nd, scaling)
        start = nd
        for i in range(nd, ctx.num_seqs):
            n, total = ctx.query_lens[i], ctx.context_lens[i]
            out[start : start + n] = self._prefill(layer, q[start : start + n], ctx.block_tables[i], n, total, scaling)
            start += n
        return out

    def _gather(self, cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
        """``[length, Hkv, D]`` of one sequence from its block ids."""
        # index_select, not cache[blocks]: advanced indexing is ~30x slower on CPU for this.
        return cache.index_select(0, blocks).reshape(-1, *cache.shape[2:])[:length]

    def _prefill(self, layer: int, q, blocks, n: int, total: int, scaling: float):
        used = blocks[: (total + self.block_size - 1) // self.block_size]
        keys = self._gather(self.k[layer], used, total).transpose(0, 1)  # [Hkv, L, D]
        values = self._gather(self.v[layer], used, total).transpose(0, 1)
        mask = None
        if n > 1:
            # Query i sits at position total - n + i and sees keys up to it.
            mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=total - n)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, scale=scaling, enable_gqa=True)
        return out.transpose(0, 1)

    def _decode(self, layer: int, q, ctx: ForwardContext, num: int, scaling: float):
        """One query for each of the first ``num`` sequences, all at once: ``q [B, Hq, D]`` → ``[B, Hq, D]``."""
        lens = ctx.context_lens_tensor[:num]
        longest = max(ctx.context_lens[:num])
        width = (longest + self.block_size - 1) // self.block_size
        tables = ctx.block_tables[:num, :width]
        k_cache, v_cache = self.k[layer], self.v[layer]
        flat = tables.reshape(-1)
        keys = k_cache.index_select(0, flat).reshape(num, -1, *k_cache.shape[2:])[:, :longest]  # [B, L, Hkv, D]
        values = v_cache.index_select(0, flat).reshape(num, -1, *v_cache.shape[2:])[:, :longest]
        mask = None
        if num > 1:
            mask = (torch.arange(longest, device=q.device)[None, :] < lens[:, None])[:, None, None, :]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :], keys.transpose(1, 2), values.transpose(1, 2), attn_mask=mask, scale=scaling, enable_gqa=True
        )
        return out[:, :, 0, :]
