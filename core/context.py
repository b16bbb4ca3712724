"""The per-step context every layer of one forward pass reads.

One object carries the step's metadata so that layer signatures stay ``(hidden, residual, ctx)``.
Token-major tensors are ``[T, ...]`` where ``T = sum(query_lens)``: the new tokens of every
sequence in the step, sequence after sequence.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch


@attrs.define(kw_only=True)
class ForwardContext:
    """What one step runs: which sequences, how many new tokens each, at which positions."""

    positions: torch.Tensor  # [T] int64, absolute position of each new token
    seq_ids: tuple[int, ...]  # [B]
    query_lens: tuple[int, ...]  # [B] new tokens per sequence
    context_lens: tuple[int, ...]  # [B] tokens in the cache after this step (cached + new)
    is_prefill: bool
    kv_cache: Any = None  # the attention backend: writes this step's K/V and attends
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None  # set by the model once per step

    def __attrs_post_init__(self):
        assert len(self.seq_ids) == len(self.query_lens) == len(self.context_lens)
        assert all(q <= c for q, c in zip(self.query_lens, self.context_lens))
        assert self.positions.shape == (sum(self.query_lens),)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @classmethod
    def build(
        cls, seq_ids, query_lens, context_lens, *, is_prefill: bool, kv_cache: Any = None, device="cpu"
    ) -> ForwardContext:
        """A context whose positions run ``context_len - query_len .. context_len - 1`` per sequence."""
        positions = torch.cat(
            [torch.arange(c - q, c, dtype=torch.long) for q, c in zip(query_lens, context_lens)]
        ).to(device)
        return cls(
            positions=positions,
            seq_ids=tuple(seq_ids),
            query_lens=tuple(query_lens),
            context_lens=tuple(context_lens),
            is_prefill=is_prefill,
            kv_cache=kv_cache,
        )

    def last_token_indices(self) -> torch.Tensor:
        """``[B]`` index into ``[T]`` of each sequence's last new token (where logits are taken)."""
        ends = torch.tensor(self.query_lens, dtype=torch.long).cumsum(0) - 1
        return ends.to(self.positions.device)
