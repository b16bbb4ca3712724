"""The recurrent-state half of the scheduler's ledger: pool slots, prefix snapshots, the rollback ring.

Device-free. The scheduler asks it, while planning a step, to give every sequence in the step the
state at its KV cursor (a fresh zero state, a prefix-cache snapshot, or the state it left last
step) and to plan the step's captures; the tensor work this implies is written down as
`StateCopy` orders that travel in the step plan, and the model runner carries them out on the
state pool. After the scheduler committed the step's blocks the ledger registers the new prefix
snapshots; when the scheduler rewinds a sequence it decides which snapshot to restore (an order
for the next plan) and says where that is (the tokens in between are recomputed).

Own-state layers (``uses_ssm_pool`` False) keep their state objects in the runner; the ledger only
knows which sequences hold them, and asks for fresh ones when a sequence (re)starts.

Invariant: a live slot holds the state after exactly ``seq.num_cached`` tokens, once the orders
planned so far are carried out.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence as Seq

import attrs

from layerzoo.runtime.block_manager import BlockManager
from layerzoo.runtime.plan import StateCopy
from layerzoo.runtime.snapshots import RollbackRing, SnapshotIndex
from layerzoo.runtime.state_pool import SlotAllocator

log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class StateConfig:
    max_seqs: int
    snapshot_slots: int = 16  # prefix-cache snapshots kept (0: no prefix matching for pool models)
    ring_depth: int = 2  # rollback-ring snapshots per sequence
    snapshot_interval: int = 0  # also snapshot every this many blocks inside prompts (0: off)
    draft_slots_per_seq: int = 0  # per-draft states of a speculative verify (k + 1)

    @property
    def num_slots(self) -> int:
        # live + ring + drafts per sequence, the snapshots, and one pending capture per sequence
        return self.max_seqs * (2 + self.ring_depth + self.draft_slots_per_seq) + self.snapshot_slots


@attrs.define
class _Pending:
    seq_id: int
    cursor: int  # the state after this many tokens (a block boundary)
    slot: int


class StateLedger:
    def __init__(self, config: StateConfig, blocks: BlockManager, *, has_pool: bool, has_own_state: bool = False):
        self.config = config
        self.blocks = blocks
        self.slots = SlotAllocator(config.num_slots) if has_pool else None
        self.has_own_state = has_own_state
        self.live: dict[int, int] = {}  # seq_id -> its live pool slot
        self.own: set[int] = set()  # seq_ids whose own-state layers hold a state in the runner
        self.snapshots = SnapshotIndex(config.snapshot_slots if has_pool else 0)
        self.ring = RollbackRing(config.ring_depth)
        self._pending: list[_Pending] = []
        self.drafts: dict[int, list[int]] = {}  # seq -> the state after verify row r + 1, r = 0..d-1
        self._copies: list[StateCopy] = []  # orders for the next plan, in order
        self._fresh_own: list[int] = []
        self.snapshot_hits = 0
        self.snapshots_taken = 0

    @property
    def has_pool(self) -> bool:
        return self.slots is not None

    @property
    def active(self) -> bool:
        return self.has_pool or self.has_own_state

    def take_orders(self) -> tuple[tuple[StateCopy, ...], tuple[int, ...]]:
        """The copy orders and fresh own-state requests planned since the last call (for a plan)."""
        copies, self._copies = tuple(self._copies), []
        fresh, self._fresh_own = tuple(dict.fromkeys(self._fresh_own)), []
        return copies, fresh

    # -- prefix matching -----------------------------------------------------------------------

    def usable_prefix_blocks(self, serials: Seq[int]) -> int:
        """The block manager's match limit: a pool model can only resume where a snapshot is, and
        a model with own-state layers only from the start (their states are not snapshotted)."""
        if self.has_own_state:
            return 0
        return self.snapshots.usable_blocks(serials) if self.has_pool else len(serials)

    # -- sequences -------------------------------------------------------------------------------

    def setup(self, seq, start: int) -> None:
        """Make ``seq``'s state the state after ``start`` tokens before a chunk starting there."""
        if self.has_own_state and seq.seq_id not in self.own:
            self.own.add(seq.seq_id)
            self._fresh_own.append(seq.seq_id)
        if not self.has_pool or seq.seq_id in self.live:
            return
        slot = self._allocate()
        assert slot is not None, "state pool exhausted: more running sequences than max_num_seqs"
        self.live[seq.seq_id] = slot
        if start == 0:
            self._copies.append(StateCopy(None, slot))
            return
        # Admitted with a prefix hit (or forked): the match ended on a snapshot by construction.
        assert start % self.blocks.block_size == 0, start
        serial = self.blocks.prefix_serials(seq.seq_id)[start // self.blocks.block_size - 1]
        self._copies.append(StateCopy(self.snapshots.lookup(serial), slot))
        self.snapshot_hits += 1

    def free(self, seq) -> None:
        """The sequence gave up its KV (finished, aborted, preempted): free every slot it holds."""
        self.own.discard(seq.seq_id)
        if not self.has_pool:
            return
        slot = self.live.pop(seq.seq_id, None)
        if slot is not None:
            self.slots.free(slot)
        for slot in self.ring.release(seq.seq_id):
            self.slots.free(slot)
        keep = []
        for p in self._pending:
            if p.seq_id == seq.seq_id:
                self.slots.free(p.slot)
            else:
                keep.append(p)
        self._pending = keep
        for slot in self.drafts.pop(seq.seq_id, ()):
            self.slots.free(slot)

    def _allocate(self) -> int | None:
        slots = self.slots
        while not slots.can_allocate() and len(self.snapshots):
            slots.free(self.snapshots.evict_oldest())
        return slots.allocate() if slots.can_allocate() else None

    # -- captures --------------------------------------------------------------------------------

    def prefix_capture_point(self, seq) -> int:
        """Where a prompt's snapshot is taken: the deepest block boundary a later match can reach."""
        bs = self.blocks.block_size
        return (len(seq.prompt_token_ids) - 1) // bs * bs

    def plan_captures(self, chunk, before_boundary: bool = False) -> list[tuple[int, int]]:
        """``(row, slot)`` captures for one chunk, rows in ``1..num_tokens``; one before the
        first row becomes a copy order of the live slot.

        * a prefix snapshot at the prompt's capture point and at chunk ends on block boundaries
          below it (prefix caching on);
        * a rollback-ring entry before a boundary token is fed (``before_boundary``: the chunk is one
          token, a line or sentence end the loop watchdog may rewind to).
        """
        if not self.has_pool:
            return []
        seq, start, end = chunk.seq, chunk.start, chunk.start + chunk.num_tokens
        captures = []
        if self.snapshots.capacity and self.blocks.enable_prefix_caching:
            cp = self.prefix_capture_point(seq)
            bs = self.blocks.block_size
            points = {cp} if start < cp <= end else set()
            if end % bs == 0 and start < end < cp:
                points.add(end)
            step = self.config.snapshot_interval * bs
            if step:  # shared prefixes shorter than a whole prompt (a system prompt) resume too
                points.update(range((start // step + 1) * step, min(end, cp) + 1, step))
            for point in sorted(points):
                slot = self._allocate()
                if slot is None:
                    log.debug("no free state slot for a prefix snapshot of %r", seq)
                    continue
                self._pending.append(_Pending(seq.seq_id, point, slot))
                captures.append((point - start, slot))
        entries = self.ring.entries(seq.seq_id)
        # Re-feeding a boundary token after a rewind to it: the ring already holds that state.
        fresh = not entries or entries[-1][0] < start
        if self.ring.depth and before_boundary and chunk.num_tokens == 1 and fresh:
            slot = self._allocate()
            if slot is not None:
                freed = self.ring.push(seq.seq_id, start, slot)
                if freed is not None:
                    self.slots.free(freed)
                captures.append((0, slot))
        live = self.live[seq.seq_id]
        self._copies.extend(StateCopy(live, slot) for row, slot in captures if row == 0)
        return sorted((row, slot) for row, slot in captures if row > 0)

    def plan_draft_captures(self, chunk) -> list[tuple[int, int]]:
        """Per-draft states of a verify chunk: the state after each of its rows but the last
        (the live slot ends with the state after all of them)."""
        if not self.has_pool or not chunk.draft:
            return []
        assert chunk.seq.seq_id not in self.drafts, "a verify is still open for this sequence"
        slots = [self._allocate() for _ in chunk.draft]
        assert all(s is not None for s in slots), "state pool has no room for per-draft states"
        self.drafts[chunk.seq.seq_id] = slots
        return [(row + 1, slot) for row, slot in enumerate(slots)]

    def verified(self, seq) -> None:
        """A verify of ``seq`` is done (the runner kept the state after its accepted rows): free
        its per-draft slots."""
        for slot in self.drafts.pop(seq.seq_id, ()):
            self.slots.free(slot)

    def commit_snapshots(self) -> None:
        """After the scheduler committed the step's blocks: index each captured prefix snapshot."""
        bs = self.blocks.block_size
        pending, self._pending = self._pending, []
        for p in pending:
            serials = self.blocks.prefix_serials(p.seq_id) if self.blocks.has_sequence(p.seq_id) else []
            n = p.cursor // bs
            if len(serials) < n or serials[n - 1] in self.snapshots:
                self.slots.free(p.slot)  # the chain did not register, or the same prefix is cached
                continue
            while self.snapshots.full():
                self.slots.free(self.snapshots.evict_oldest())
            self.snapshots.insert(serials[n - 1], p.slot)
            self.snapshots_taken += 1

    # -- rewinding ---------------------------------------------------------------------------------

    def rewind(self, seq, cursor: int) -> int:
        """Restore the deepest snapshot at or before ``cursor`` into the live slot; returns its cursor.

        Candidates are the sequence's rollback-ring entries and the prefix snapshots on its own
        chain of blocks; with neither, the state restarts from zero (the tokens are recomputed).
        """
        if seq.seq_id in self.own:
            # Own states cannot be rewound in place: start every state again, recompute every token.
            self.free(seq)
            self.setup(seq, 0)
            return 0
        slot = self.live.get(seq.seq_id)
        if not self.has_pool or slot is None:
            return cursor
        best = self.ring.best_at_or_before(seq.seq_id, cursor)
        bs = self.blocks.block_size
        serials = self.blocks.prefix_serials(seq.seq_id)[: cursor // bs]
        n = self.snapshots.usable_blocks(serials)
        if n and (best is None or n * bs > best[0]):
            best = (n * bs, self.snapshots.lookup(serials[n - 1]))
        if best is None:
            self._copies.append(StateCopy(None, slot))
            restored = 0
        else:
            restored, src = best
            self._copies.append(StateCopy(src, slot))
        for freed in self.ring.drop_after(seq.seq_id, restored):
            self.slots.free(freed)
        return restored

    def check_invariants(self) -> None:
        if not self.has_pool:
            return
        self.slots.check_invariants()
        held = list(self.live.values()) + self.snapshots.slots() + [p.slot for p in self._pending]
        held += [s for slots in self.drafts.values() for s in slots]
        held += self.ring.slots()
        assert len(held) == len(set(held)), "a state slot has two owners"
        assert len(held) == self.slots.num_slots - self.slots.num_free(), "a state slot leaked"
