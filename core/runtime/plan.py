"""The step plan: what the scheduler decided for one step, as plain data.

The scheduler (device-free) writes it; the model runner (which owns the device) executes it and
nothing else: no callback runs between them. Everything is plain Python data, so that one process
can later broadcast a plan to tensor-parallel workers.

A plan holds the step's chunks (decode rows, speculative verifies, prompt chunks) with their block
tables, the recurrent-state slot of each sequence and the captures inside its rows, and the copy
orders the state pool must carry out before the pass (a fresh zero state, a restored snapshot, a
snapshot taken before a chunk's first row).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from layerzoo.sequence import Sequence


@attrs.frozen
class Chunk:
    """``num_tokens`` new tokens of ``seq`` from position ``start`` on, run in one step.

    A speculative verify is a decode chunk carrying ``draft`` tokens after the sequence's last
    token: it runs ``1 + len(draft)`` rows and every row yields logits.
    """

    seq: Sequence
    start: int
    num_tokens: int
    draft: tuple[int, ...] = ()

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the sequence's end, so its last row yields a token."""
        return self.start + self.num_tokens - len(self.draft) == len(self.seq)

    @property
    def is_verify(self) -> bool:
        return bool(self.draft)


@attrs.frozen
class StateCopy:
    """Copy the state in pool slot ``src`` into ``dst`` (every pool layer); ``src`` None: zero ``dst``."""

    src: int | None
    dst: int


@attrs.frozen
class StepPlan:
    decodes: tuple[Chunk, ...]
    prefills: tuple[Chunk, ...]
    preempted: tuple[Sequence, ...] = ()
    finished: tuple[Sequence, ...] = ()  # finished while scheduling (they outgrew the whole cache)
    block_tables: Mapping[int, tuple[int, ...]] = attrs.field(factory=dict)  # seq_id -> its blocks
    freed: tuple[int, ...] = ()  # seq_ids that gave up their KV and state since the last plan
    # Recurrent state (models with pool layers or own-state layers):
    state_copies: tuple[StateCopy, ...] = ()  # carried out in order, before the step's passes
    state_slots: Mapping[int, int] = attrs.field(factory=dict)  # seq_id -> live pool slot
    # seq_id -> (row, slot): after ``row`` rows of its chunk (1..num_tokens) copy the state into ``slot``
    captures: Mapping[int, tuple[tuple[int, int], ...]] = attrs.field(factory=dict)
    draft_slots: Mapping[int, tuple[int, ...]] = attrs.field(factory=dict)  # verify: state after row r + 1
    fresh_own_states: tuple[int, ...] = ()  # seq_ids whose own-state layers start from a new state

    @property
    def chunks(self) -> tuple[Chunk, ...]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks
