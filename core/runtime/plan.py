"""The step plan: what the scheduler decided for one step, as plain data.

The scheduler (device-free) writes it; the model runner (which owns the device) executes it and
nothing else: no callback runs between them. Everything is plain Python data, so that one process
can broadcast a plan to tensor-parallel workers: `StepPlan.for_workers` swaps each `Chunk`
(which points at its live `Sequence`) for a `ChunkRows` that carries only what a forward pass
reads (seq_id, the chunk's token ids, start, draft), so the message is small and pickles no
sampling state.

A plan holds the step's chunks (decode rows, speculative verifies, prompt chunks) with their block
tables, the recurrent-state slot of each sequence and the captures inside its rows, and the copy
orders the state pool must carry out before the pass (the state after a verify's kept rows, a fresh
zero state, a restored snapshot, a snapshot taken before a chunk's first row). It is the runner's
only channel: sequences that finished or were aborted since the last plan are freed by the next
one (`freed`), and what a verify kept reaches the states by the next one too (`verified`).
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs

from layerzoo.runtime.sequence import Sequence


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
        """Whether this chunk reaches the sequence's end, so its last row yields a token (never
        for a pooling request: its rows are pooled, see `pool_rows`)."""
        return self.start + self.num_tokens - len(self.draft) == len(self.seq) and self.seq.pooled is None

    @property
    def pool_rows(self) -> tuple[int, int, bool] | None:
        """A pooling request's rows of this chunk to pool: ``(lo, hi, last)`` — the sum of rows
        ``lo .. hi`` (mean; positions already pooled before a preemption left out), or row
        ``hi - 1`` alone (``last``: the prompt's last token). None: nothing to pool here."""
        pooled = self.seq.pooled
        if pooled is None:
            return None
        end = self.start + self.num_tokens
        if pooled.params.method == "last":
            last = len(self.seq.prompt_token_ids) - 1
            return (last - self.start, last - self.start + 1, True) if self.start <= last < end else None
        lo = max(self.start, pooled.num_rows)
        return (lo - self.start, end - self.start, False) if lo < end else None

    @property
    def is_verify(self) -> bool:
        return bool(self.draft)

    @property
    def prompt_rows(self) -> tuple[int, int]:
        """Rows ``lo .. hi`` of this chunk whose logits score the next prompt token for the
        request's ``prompt_logprobs`` (row r, at position ``start + r``, predicts the token after
        it); the rows of positions already scored (before a preemption) are left out. ``(0, 0)``: none."""
        scored = self.seq.prompt_logprobs
        if scored is None:
            return (0, 0)
        lo = max(self.start, len(scored) - 1)
        hi = min(self.start + self.num_tokens - len(self.draft), len(self.seq.prompt_token_ids) - 1)
        return (lo - self.start, hi - self.start) if lo < hi else (0, 0)

    @property
    def seq_id(self) -> int:
        return self.seq.seq_id

    @property
    def token_ids(self) -> list[int]:
        """The chunk's input tokens (drafts last), without building a long sequence's whole list."""
        seq, start, end = self.seq, self.start, self.start + self.num_tokens - len(self.draft)
        prompt_len = len(seq.prompt_token_ids)
        if start >= prompt_len:
            tokens = seq.output_token_ids[start - prompt_len : end - prompt_len]
        else:
            tokens = (seq.prompt_token_ids + seq.output_token_ids)[start:end]
        return tokens + list(self.draft) if self.draft else tokens

    def sub(self, offset: int, num_tokens: int) -> Chunk:
        """Rows ``offset .. offset + num_tokens`` of this (non-verify) chunk, as a chunk."""
        assert not self.draft and 0 <= offset and offset + num_tokens <= self.num_tokens
        return Chunk(self.seq, self.start + offset, num_tokens)

    def rows(self) -> ChunkRows:
        """What a tensor-parallel worker needs of this chunk to run the same forward."""
        return ChunkRows(
            self.seq.seq_id, self.start, self.num_tokens, tuple(self.token_ids), self.draft, self.samples, self.prompt_rows
        )


@attrs.frozen
class ChunkRows:
    """A `Chunk` as plain data: its rows' token ids instead of the sequence (``len(token_ids) ==
    num_tokens``; a verify's drafts are its last ``len(draft)`` tokens). Tensor-parallel workers
    run these: they hold no `Sequence` and never sample."""

    seq_id: int
    start: int
    num_tokens: int
    token_ids: tuple[int, ...]
    draft: tuple[int, ...] = ()
    samples: bool = False
    prompt_rows: tuple[int, int] = (0, 0)  # rows whose logits rank 0 takes for prompt logprobs

    def __attrs_post_init__(self):
        assert len(self.token_ids) == self.num_tokens, (len(self.token_ids), self.num_tokens)

    @property
    def is_verify(self) -> bool:
        return bool(self.draft)

    def sub(self, offset: int, num_tokens: int) -> ChunkRows:
        assert not self.draft and 0 <= offset and offset + num_tokens <= self.num_tokens
        ends = offset + num_tokens == self.num_tokens
        lo, hi = max(self.prompt_rows[0] - offset, 0), min(self.prompt_rows[1] - offset, num_tokens)
        return ChunkRows(
            self.seq_id, self.start + offset, num_tokens, self.token_ids[offset : offset + num_tokens], (),
            self.samples and ends, (lo, hi) if lo < hi else (0, 0),
        )


@attrs.frozen
class StateCopy:
    """Copy the state in pool slot ``src`` into ``dst`` (every pool layer); ``src`` None: zero ``dst``."""

    src: int | None
    dst: int


@attrs.frozen
class StepPlan:
    decodes: tuple[Chunk, ...]  # (`ChunkRows` in a worker's copy)
    prefills: tuple[Chunk, ...]
    preempted: tuple[Sequence, ...] = ()
    finished: tuple[Sequence, ...] = ()  # finished while scheduling (they outgrew the whole cache)
    block_tables: Mapping[int, tuple[int, ...]] = attrs.field(factory=dict)  # seq_id -> its blocks
    freed: tuple[int, ...] = ()  # seq_ids that gave up their KV and state since the last plan
    # The previous plan's verifies, decided after its pass: seq_id -> (rows kept, rows run). Own-state
    # layers keep their state after the kept rows; pool layers get it by the first copy orders.
    verified: Mapping[int, tuple[int, int]] = attrs.field(factory=dict)
    # Recurrent state (models with pool layers or own-state layers):
    state_copies: tuple[StateCopy, ...] = ()  # carried out in order, after `verified`, before the passes
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

    def for_workers(self) -> StepPlan:
        """This plan as tensor-parallel workers get it: chunks as `ChunkRows`, no `Sequence` left."""
        return attrs.evolve(
            self,
            decodes=tuple(c.rows() for c in self.decodes),
            prefills=tuple(c.rows() for c in self.prefills),
            preempted=(),
            finished=(),
        )
