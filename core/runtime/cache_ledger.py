"""The scheduler's one ledger of what each sequence holds in the runner's pools.

Device-free. Two books, kept in step here so the scheduler never pairs them itself:

* `BlockManager`: KV block tables, reference counts and the prefix cache;
* `StateLedger` (a model with recurrent state only): state-pool slots, prefix snapshots, the
  rollback ring, per-draft states and own-state sequences.

Every operation a sequence goes through touches both where both exist: admission matches a cached
prefix only as deep as the state can resume (a snapshot, or nothing for own-state layers); a free
gives back blocks and slots; a rewind lowers the KV cursor and restores the deepest snapshot at or
below it, lowering both until they agree; the state work a step needs is written down as orders
for the step plan (`plan_states`).
"""

from __future__ import annotations

from collections.abc import Callable
from collections.abc import Sequence as Seq

from layerzoo.runtime.block_manager import BlockManager
from layerzoo.runtime.plan import Chunk
from layerzoo.runtime.state_ledger import StateLedger


class CacheLedger:
    def __init__(self, blocks: BlockManager, states: StateLedger | None = None):
        self.blocks = blocks
        # None for a model without recurrent state (no pool slots, no own-state layers).
        self.states = states if states is not None and states.active else None
        # Where a prefix match may stop: at a state snapshot for a model with recurrent state.
        self._limit = self.states.usable_prefix_blocks if self.states is not None else None

    # -- KV room ---------------------------------------------------------------------------------

    def holds(self, seq_id: int) -> bool:
        """Whether the sequence holds KV blocks (admitted and not freed or preempted)."""
        return self.blocks.has_sequence(seq_id)

    def can_grow(self, seq_id: int, num_tokens: int) -> bool:
        return self.blocks.can_append(seq_id, num_tokens)

    def grow(self, seq_id: int, num_tokens: int) -> None:
        """Blocks for ``num_tokens`` positions in all (never fewer than it holds)."""
        self.blocks.append(seq_id, num_tokens)

    def table(self, seq_id: int) -> tuple[int, ...]:
        return tuple(self.blocks.block_table(seq_id))

    # -- admission ---------------------------------------------------------------------------------

    def match(self, token_ids: Seq[int]) -> int:
        """Tokens of ``token_ids`` a new sequence could resume after (whole cached blocks, as deep
        as its state can resume)."""
        return self.blocks.match_prefix(token_ids, self._limit)

    def can_admit(self, token_ids: Seq[int], num_tokens: int) -> bool:
        return self.blocks.can_allocate(token_ids, num_tokens, self._limit)

    def admit(self, seq_id: int, token_ids: Seq[int], num_tokens: int) -> int:
        """Blocks for ``num_tokens`` positions, the matched prefix shared; returns the cursor."""
        return self.blocks.allocate(seq_id, token_ids, num_tokens, self._limit)

    def fork(self, parent_id: int, child_id: int, num_tokens: int) -> int:
        """Share the parent's first whole blocks (at most ``num_tokens`` positions) with a sibling;
        returns the cursor."""
        return self.blocks.fork(parent_id, child_id, num_tokens, self._limit)

    # -- release -----------------------------------------------------------------------------------

    def free(self, seq) -> None:
        """The sequence gave up its KV (finished, aborted, preempted): its blocks and state slots."""
        if self.blocks.has_sequence(seq.seq_id):
            self.blocks.free_sequence(seq.seq_id)
        if self.states is not None:
            self.states.free(seq)

    # -- a step ----------------------------------------------------------------------------------

    def plan_states(self, chunks: Seq[Chunk], before_boundary: Callable[[Chunk], bool]) -> dict:
        """The state work of a step running ``chunks``, as `StepPlan` fields (empty without
        recurrent state): each sequence's live slot set up, captures, per-draft slots, the copy
        orders and fresh own-state requests planned since the last step."""
        states = self.states
        if states is None:
            return {}
        # Every sequence's state first: a capture slot may evict a prefix snapshot, and one that a
        # sequence of this step still has to restore must be copied out before that.
        for chunk in chunks:
            states.setup(chunk.seq, chunk.start)
        captures = {}
        for chunk in chunks:
            planned = states.plan_captures(chunk, before_boundary(chunk)) + states.plan_draft_captures(chunk)
            if planned:
                captures[chunk.seq.seq_id] = tuple(planned)
        copies, fresh = states.take_orders()
        return {
            "state_copies": copies,
            "state_slots": {c.seq.seq_id: states.live[c.seq.seq_id] for c in chunks} if states.has_pool else {},
            "captures": captures,
            "draft_slots": {c.seq.seq_id: tuple(states.drafts[c.seq.seq_id]) for c in chunks if c.seq.seq_id in states.drafts},
            "fresh_own_states": fresh,
        }

    def commit(self, seq) -> None:
        """After a step: register the sequence's newly computed full blocks in the prefix cache."""
        self.blocks.commit(seq.seq_id, seq.token_ids, seq.num_cached)

    def commit_snapshots(self) -> None:
        """After every sequence of the step was committed: index the step's state snapshots."""
        if self.states is not None:
            self.states.commit_snapshots()

    def verified(self, seq) -> None:
        """A verify of ``seq`` ran: its per-draft state slots are free."""
        if self.states is not None:
            self.states.verified(seq)

    def drop_rejected(self, seq_id: int, num_tokens: int) -> int:
        """After a verify: the blocks only rejected drafts used, past ``num_tokens`` positions.
        The state is not touched (the next plan copies the kept rows' state)."""
        return self.blocks.rewind(seq_id, num_tokens)

    # -- rewinding ---------------------------------------------------------------------------------

    def rewind(self, seq, cursor: int) -> int:
        """Lower ``seq``'s KV cursor to at most ``cursor`` and restore its state there; returns
        where both agree (the tokens after it are recomputed).

        Recurrent state restores only at its snapshots, and a KV rewind may land lower than asked
        (a shared block is never written): lower both until they agree.
        """
        cursor = self.blocks.rewind(seq.seq_id, cursor)
        while self.states is not None and (restored := self.states.rewind(seq, cursor)) != cursor:
            assert restored < cursor, (restored, cursor)
            cursor = self.blocks.rewind(seq.seq_id, restored)
        return cursor

    def check_invariants(self) -> None:
        self.blocks.check_invariants()
        if self.states is not None:
            self.states.check_invariants()
