"""A simple contiguous per-sequence KV cache and the attention that reads it.

Each sequence owns, for every attention layer, K and V buffers ``[capacity, Hkv, D]`` that grow by
doubling. It is the foundation's cache: the paged pool of the runtime replaces it behind the same
``attend`` call, and layers declare what they store per token through `KVCacheSpec`.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
import torch.nn.functional as F

from layerzoo.context import ForwardContext


@attrs.frozen
class KVCacheSpec:
    """What one attention layer stores per token: K and V of ``num_kv_heads x head_dim``."""

    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()


class _SequenceKV:
    """One sequence's K/V buffers for every layer, with its cached length."""

    def __init__(self, specs: Mapping[int, KVCacheSpec], device, capacity: int = 64):
        self.length = 0
        self.k = {i: torch.empty(capacity, s.num_kv_heads, s.head_dim, dtype=s.dtype, device=device) for i, s in specs.items()}
        self.v = {i: torch.empty_like(t) for i, t in self.k.items()}

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        end = start + k.shape[0]
        if end > self.k[layer].shape[0]:
            self._grow(layer, end)
        self.k[layer][start:end] = k
        self.v[layer][start:end] = v

    def _grow(self, layer: int, needed: int) -> None:
        capacity = max(needed, 2 * self.k[layer].shape[0])
        for buffers in (self.k, self.v):
            old = buffers[layer]
            new = old.new_empty(capacity, *old.shape[1:])
            new[: old.shape[0]] = old
            buffers[layer] = new


class ContiguousKVCache:
    """Per-sequence contiguous K/V for every attention layer of a model."""

    def __init__(self, specs: Mapping[int, KVCacheSpec], device="cpu"):
        self.specs = dict(specs)
        self.device = device
        self.seqs: dict[int, _SequenceKV] = {}

    def add_sequence(self, seq_id: int) -> None:
        assert seq_id not in self.seqs, f"sequence {seq_id} already has a cache"
        self.seqs[seq_id] = _SequenceKV(self.specs, self.device)

    def free_sequence(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    def length(self, seq_id: int) -> int:
        return self.seqs[seq_id].length

    def commit(self, ctx: ForwardContext) -> None:
        """Record the step's new tokens as cached (after every layer has written them)."""
        for seq_id, total in zip(ctx.seq_ids, ctx.context_lens):
            self.seqs[seq_id].length = total

    def rewind(self, seq_id: int, length: int) -> None:
        """Lower a sequence's cursor: tokens past ``length`` are forgotten."""
        assert 0 <= length <= self.seqs[seq_id].length
        self.seqs[seq_id].length = length

    def attend(self, layer: int, q, k, v, scaling: float, ctx: ForwardContext) -> torch.Tensor:
        """Write the step's K/V for ``layer`` and attend causally over each sequence's cache.

        Args:
            q: ``[T, Hq, D]``; k, v: ``[T, Hkv, D]`` (already rotated).
        Returns:
            ``[T, Hq, D]``.
        """
        offsets = [0]
        for seq_id, n, total in zip(ctx.seq_ids, ctx.query_lens, ctx.context_lens):
            self.seqs[seq_id].write(layer, total - n, k[offsets[-1] : offsets[-1] + n], v[offsets[-1] : offsets[-1] + n])
            offsets.append(offsets[-1] + n)
        if all(n == 1 for n in ctx.query_lens) and ctx.num_seqs > 1:
            return self._decode_batched(layer, q, scaling, ctx)
        outs = [
            self._attend_one(layer, q[a:b], seq_id, n, total, scaling)
            for seq_id, n, total, a, b in zip(ctx.seq_ids, ctx.query_lens, ctx.context_lens, offsets, offsets[1:])
        ]
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _attend_one(self, layer, q, seq_id, n, total, scaling):
        seq = self.seqs[seq_id]
        keys = seq.k[layer][:total].transpose(0, 1)  # [Hkv, L, D]
        values = seq.v[layer][:total].transpose(0, 1)
        mask = None
        if n > 1:
            # Query i sits at position total - n + i and sees keys up to it.
            mask = torch.ones(n, total, dtype=torch.bool, device=q.device).tril(diagonal=total - n)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1), keys, values, attn_mask=mask, scale=scaling, enable_gqa=True
        )
        return out.transpose(0, 1)

    def _decode_batched(self, layer, q, scaling, ctx):
        lens = ctx.context_lens
        longest = max(lens)
        spec = self.specs[layer]
        keys = q.new_zeros(ctx.num_seqs, longest, spec.num_kv_heads, spec.head_dim)
        values = torch.zeros_like(keys)
        for row, (seq_id, total) in enumerate(zip(ctx.seq_ids, lens)):
            keys[row, :total] = self.seqs[seq_id].k[layer][:total]
            values[row, :total] = self.seqs[seq_id].v[layer][:total]
        valid = torch.arange(longest, device=q.device)[None, :] < torch.tensor(lens, device=q.device)[:, None]
        out = F.scaled_dot_product_attention(
            q[:, :, None, :],  # [B, Hq, 1, D]
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=valid[:, None, None, :],
            scale=scaling,
            enable_gqa=True,
        )
        return out[:, :, 0, :]
