"""The paged KV pool: per-layer K/V storage in fixed-size blocks, and attention over it.

Every attention layer owns ``k, v [num_blocks, block_size, Hkv, D]``. A token at position ``p`` of
a sequence lives in block ``block_table[p // block_size]`` at offset ``p % block_size``; the step's
``slot_mapping [T]`` holds ``block * block_size + offset`` for each new token. Block ids come from
the device-free `BlockManager`; this module only stores and reads.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from layerzoo.context import ForwardContext
from layerzoo.kv_cache import KVCacheSpec
from layerzoo.layers.ops import kernel


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
        self._decode_op = kernel("paged_decode_attention")
        self._prefill_op = kernel("paged_prefill_attention")

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
            return self._decode_op(q, k_cache, v_cache, ctx.block_tables, ctx.context_lens_tensor, scaling)
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self._decode_op(q[:nd], k_cache, v_cache, ctx.block_tables[:nd], ctx.context_lens_tensor[:nd], scaling)
        out[nd:] = self._prefill_op(
            q[nd:], k_cache, v_cache, ctx.block_tables[nd:], ctx.query_start_tensor(nd), ctx.context_lens_tensor[nd:], scaling
        )
        return out
