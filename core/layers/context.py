"""The per-step context every layer of one forward pass reads.

One object carries the step's metadata so that layer signatures stay ``(hidden, residual, ctx)``.
Token-major tensors are ``[T, ...]`` where ``T = sum(query_lens)``: the new tokens of every
sequence in the step, sequence after sequence, the one-token decode rows first.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch


@attrs.define(kw_only=True)
class ForwardContext:
    """What one step runs: which sequences, how many new tokens each, where their K/V go."""

    positions: torch.Tensor  # [T] int64, absolute position of each new token
    seq_ids: tuple[int, ...]  # [B]
    query_lens: tuple[int, ...]  # [B] new tokens per sequence
    context_lens: tuple[int, ...]  # [B] tokens in the cache after this step (cached + new)
    num_decodes: int  # the first num_decodes sequences are one-token decode rows
    slot_mapping: torch.Tensor | None = None  # [T] int64, block * block_size + offset of each new token
    block_tables: torch.Tensor | None = None  # [B, max_blocks] int64 (padded with 0)
    context_lens_tensor: torch.Tensor | None = None  # [B] int64
    token_seqs: torch.Tensor | None = None  # [T] int64, the sequence (0..B-1) of each new token
    kv_cache: Any = None  # the attention backend: writes this step's K/V and attends
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None = None  # set by the model once per step
    ssm: Any = None  # layerzoo.runtime.state_pool.SsmStep: state-pool slots and captures, for pool layers
    layer_states: dict[int, tuple[Any, ...]] | None = None  # own-state layers: layer index -> [B] state objects
    # A captured decode step (CUDA graph, compiled step): the tensors are static buffers rewritten
    # before each replay, so no op may size anything by their values (the Python tuples above are
    # those of the capture); attention takes the shape-static decode op over the whole table width.
    shape_static: bool = False
    _query_starts: dict[int, torch.Tensor] = attrs.field(factory=dict, init=False, repr=False)
    _row_queries: tuple[torch.Tensor, torch.Tensor] | None = attrs.field(default=None, init=False, repr=False)

    def __attrs_post_init__(self):
        assert len(self.seq_ids) == len(self.query_lens) == len(self.context_lens)
        assert all(0 < q <= c for q, c in zip(self.query_lens, self.context_lens))
        assert all(q == 1 for q in self.query_lens[: self.num_decodes])
        assert self.positions.shape == (sum(self.query_lens),)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.positions.shape[0])

    @property
    def is_prefill(self) -> bool:
        """Whether the step has prompt rows (a mixed step has both kinds)."""
        return self.num_decodes < self.num_seqs

    def query_start_tensor(self, first: int = 0) -> torch.Tensor:
        """``[B - first + 1]`` offsets of each sequence's rows, from sequence ``first`` on (0-based).

        Built once per step and cached: every attention layer asks for it.
        """
        if first not in self._query_starts:
            lens = torch.tensor((0, *self.query_lens[first:]), dtype=torch.long)
            self._query_starts[first] = lens.cumsum(0).to(self.positions.device)
        return self._query_starts[first]

    def row_queries(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every new token as a decode query of its own: ``(block_tables [T, W], context_lens [T])``,
        the token's sequence's table and ``position + 1`` (it sees the keys up to itself). Built once
        per step and cached (every attention layer of a short-chunk step asks for it)."""
        assert self.token_seqs is not None, "a context built without token_seqs"
        if self._row_queries is None:
            self._row_queries = (self.block_tables.index_select(0, self.token_seqs), self.positions + 1)
        return self._row_queries

    def last_token_indices(self) -> torch.Tensor:
        """``[B]`` index into ``[T]`` of each sequence's last new token (where logits are taken)."""
        ends = torch.tensor(self.query_lens, dtype=torch.long).cumsum(0) - 1
        return ends.to(self.positions.device)

    @classmethod
    def for_paged(
        cls,
        *,
        seq_ids: Sequence[int],
        query_lens: Sequence[int],
        context_lens: Sequence[int],
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        num_decodes: int,
        kv_cache: Any,
        device="cpu",
    ) -> ForwardContext:
        """A context over a paged cache: positions and slots from each sequence's block table."""
        width = max(len(t) for t in block_tables)
        tables = torch.zeros(len(block_tables), width, dtype=torch.long)
        for row, table in enumerate(block_tables):
            tables[row, : len(table)] = torch.tensor(table, dtype=torch.long)
        starts = torch.tensor([c - q for q, c in zip(query_lens, context_lens)], dtype=torch.long)
        lens = torch.tensor(query_lens, dtype=torch.long)
        row_of = torch.repeat_interleave(torch.arange(len(query_lens)), lens)
        offsets = torch.arange(int(lens.sum())) - torch.repeat_interleave(lens.cumsum(0) - lens, lens)
        positions = starts[row_of] + offsets
        slots = tables[row_of, positions // block_size] * block_size + positions % block_size
        return cls(
            positions=positions.to(device),
            seq_ids=tuple(seq_ids),
            query_lens=tuple(query_lens),
            context_lens=tuple(context_lens),
            num_decodes=num_decodes,
            slot_mapping=slots.to(device),
            block_tables=tables.to(device),
            context_lens_tensor=torch.tensor(context_lens, dtype=torch.long, device=device),
            token_seqs=row_of.to(device),
            kv_cache=kv_cache,
        )
