"""The recurrent-state pool and its bookkeeping, without a model.

`SlotAllocator`, `StatePool` copies, `SsmStep.pieces`, the prefix `SnapshotIndex`, the per-sequence
`RollbackRing`, and the `StateLedger` driven by a real `Scheduler` and `BlockManager` through random
workloads (admission with prefix hits, chunked prefill, preemption, abort, rollback), where a fake
"layer" writes a fingerprint of the tokens it has seen into the pool: every slot can then be checked
to hold the state of exactly the tokens it claims to.
"""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layerzoo.layers.kv_cache import StateSpec
from layerzoo.runtime.block_manager import BlockManager
from layerzoo.runtime.cache_ledger import CacheLedger
from layerzoo.runtime.plan import Chunk, StateCopy
from layerzoo.runtime.scheduler import Scheduler, SchedulerConfig
from layerzoo.runtime.sequence import Sequence, Status
from layerzoo.runtime.snapshots import RollbackRing, SnapshotIndex
from layerzoo.runtime.state_ledger import StateConfig, StateLedger
from layerzoo.runtime.state_pool import SlotAllocator, SsmStep, StatePool
from layerzoo.sampling import SamplingParams

SPECS = {
    0: StateSpec(conv_shape=(3, 2), recurrent_shape=(2, 2, 2)),
    2: StateSpec(conv_shape=(4, 3), recurrent_shape=(1, 3), conv_dtype=torch.float16),
}


# -- SlotAllocator ---------------------------------------------------------------------------


def test_slot_allocator_hands_out_every_usable_slot_once_and_never_the_scratch():
    slots = SlotAllocator(5)
    assert slots.pad_slot == 5 and slots.num_free() == 5 and slots.can_allocate(5) and not slots.can_allocate(6)
    got = [slots.allocate() for _ in range(5)]
    assert sorted(got) == [0, 1, 2, 3, 4] and slots.pad_slot not in got
    assert slots.num_free() == 0 and not slots.can_allocate()
    slots.check_invariants()
    with pytest.raises(AssertionError, match="exhausted"):
        slots.allocate()
    slots.free(got[2])
    assert slots.allocate() == got[2]  # the freed slot comes back
    for s in got:
        slots.free(s)
    slots.check_invariants()
    assert slots.num_free() == 5


def test_slot_allocator_rejects_double_free_and_foreign_slots():
    slots = SlotAllocator(3)
    a = slots.allocate()
    slots.free(a)
    with pytest.raises(AssertionError, match="freed twice"):
        slots.free(a)
    with pytest.raises(AssertionError):
        slots.free(slots.pad_slot)  # never allocated
    with pytest.raises(AssertionError):
        slots.free(17)
    slots.check_invariants()


def test_slot_allocator_random_churn_keeps_its_invariants():
    rng = random.Random(3)
    slots, held = SlotAllocator(7), []
    for _ in range(500):
        if held and (not slots.can_allocate() or rng.random() < 0.45):
            slots.free(held.pop(rng.randrange(len(held))))
        else:
            s = slots.allocate()
            assert s not in held and 0 <= s < 7
            held.append(s)
        slots.check_invariants()
        assert slots.num_free() == 7 - len(held)


def test_slot_allocator_needs_one_slot():
    with pytest.raises(AssertionError):
        SlotAllocator(0)


# -- StatePool -------------------------------------------------------------------------------


def fill(pool: StatePool, slot: int, value: float) -> None:
    for i in pool.specs:
        pool.conv[i][slot].fill_(value)
        pool.recurrent[i][slot].fill_(value + 0.5)


def holds(pool: StatePool, slot: int, value: float) -> bool:
    return all(
        bool((pool.conv[i][slot] == value).all()) and bool((pool.recurrent[i][slot] == value + 0.5).all()) for i in pool.specs
    )


def test_state_pool_shapes_dtypes_and_bytes():
    pool = StatePool(SPECS, 4)
    assert pool.layers == (0, 2)
    assert pool.conv[0].shape == (5, 3, 2) and pool.conv[0].dtype == torch.float32
    assert pool.conv[2].shape == (5, 4, 3) and pool.conv[2].dtype == torch.float16
    assert pool.recurrent[0].shape == (5, 2, 2, 2) and pool.recurrent[2].shape == (5, 1, 3)
    assert SPECS[0].bytes_per_slot == 6 * 4 + 8 * 4 and SPECS[2].bytes_per_slot == 12 * 2 + 3 * 4
    assert StatePool.bytes_for(SPECS, 4) == 5 * (56 + 36)
    assert all(bool((t == 0).all()) for t in [*pool.conv.values(), *pool.recurrent.values()])
    with pytest.raises(AssertionError):
        StatePool({}, 4)


def test_state_pool_zero_and_copy_touch_every_layer_and_only_their_slots():
    pool = StatePool(SPECS, 6)
    for s in range(7):
        fill(pool, s, float(s + 1))
    pool.zero(3)
    assert all(bool((pool.conv[i][3] == 0).all()) and bool((pool.recurrent[i][3] == 0).all()) for i in pool.specs)
    assert holds(pool, 2, 3.0) and holds(pool, 4, 5.0)
    pool.copy(1, 3)
    assert holds(pool, 3, 2.0) and holds(pool, 1, 2.0)
    pool.copy(4, 4)  # a no-op
    assert holds(pool, 4, 5.0)
    for s, v in {1: 2.0, 2: 3.0, 3: 2.0, 5: 6.0, 6: 7.0}.items():
        assert holds(pool, s, v)


def test_state_pool_copy_layer_writes_one_layer():
    pool = StatePool(SPECS, 2)
    pool.copy_layer(2, torch.full((4, 3), 3.0), torch.full((1, 3), 4.0), 1)
    assert bool((pool.conv[2][1] == 3).all()) and bool((pool.recurrent[2][1] == 4).all())
    assert bool((pool.conv[0][1] == 0).all()) and bool((pool.conv[2][0] == 0).all())


# -- SsmStep.pieces ----------------------------------------------------------------------------


def step_with(captures) -> SsmStep:
    return SsmStep(pool=StatePool(SPECS, 8), slots=tuple(range(len(captures) or 1)), captures=captures)


@pytest.mark.parametrize(
    "captures,rows,pieces",
    [
        ((), 5, [(0, 5, None)]),
        (((0, 7),), 5, [(0, 0, 7), (0, 5, None)]),  # before any row: the state as it came in
        (((2, 7),), 5, [(0, 2, 7), (2, 5, None)]),
        (((5, 7),), 5, [(0, 5, 7)]),  # after the last row: nothing left to run
        (((1, 6), (3, 7), (5, 8)), 5, [(0, 1, 6), (1, 3, 7), (3, 5, 8)]),
        (((0, 6), (4, 7)), 6, [(0, 0, 6), (0, 4, 7), (4, 6, None)]),
        (((3, 6), (3, 7)), 4, [(0, 3, 6), (3, 3, 7), (3, 4, None)]),  # two captures at one row
        (((1, 6),), 1, [(0, 1, 6)]),
    ],
)
def test_pieces(captures, rows, pieces):
    step = step_with((captures,) if captures else ())
    assert step.pieces(0, rows) == pieces
    # the pieces cover the rows in order, without gaps
    assert pieces[0][0] == 0 and pieces[-1][1] == rows
    assert all(a[1] == b[0] for a, b in zip(pieces, pieces[1:]))


def test_pieces_per_sequence_and_slots_tensor():
    step = SsmStep(pool=StatePool(SPECS, 8), slots=(4, 2), captures=((), ((2, 5),)))
    assert step.captures_of(0) == () and step.pieces(0, 1) == [(0, 1, None)]
    assert step.pieces(1, 3) == [(0, 2, 5), (2, 3, None)]
    assert step.slots_tensor.tolist() == [4, 2] and step.slots_tensor is step.slots_tensor
    plain = SsmStep(pool=step.pool, slots=(0, 1))
    assert plain.captures_of(1) == () and plain.pieces(1, 4) == [(0, 4, None)]


def test_pieces_reject_a_capture_past_the_rows():
    with pytest.raises(AssertionError):
        step_with((((6, 7),),)).pieces(0, 5)


# -- SnapshotIndex -----------------------------------------------------------------------------


def test_snapshot_index_usable_blocks_picks_the_deepest():
    idx = SnapshotIndex(4)
    idx.insert(11, 0)
    idx.insert(13, 1)
    assert idx.usable_blocks([10, 11, 12, 13, 14]) == 4
    assert idx.usable_blocks([10, 11, 12]) == 2
    assert idx.usable_blocks([10, 12]) == 0
    assert idx.usable_blocks([]) == 0
    assert 11 in idx and 12 not in idx and len(idx) == 2


def test_snapshot_index_lru_eviction_order_and_lookup_refresh():
    idx = SnapshotIndex(3)
    for serial, slot in [(1, 10), (2, 20), (3, 30)]:
        idx.insert(serial, slot)
    assert idx.full()
    with pytest.raises(AssertionError):
        idx.insert(4, 40)  # full: the caller evicts first
    assert idx.lookup(1) == 10  # 1 becomes the most recently used
    assert idx.evict_oldest() == 20
    idx.insert(4, 40)
    assert idx.evict_oldest() == 30
    assert idx.lookup(4) == 40
    assert idx.evict_oldest() == 10
    assert idx.slots() == [40] and 1 not in idx
    with pytest.raises(KeyError):
        idx.lookup(1)


def test_snapshot_index_indexes_a_serial_once():
    idx = SnapshotIndex(3)
    idx.insert(1, 10)
    with pytest.raises(AssertionError):
        idx.insert(1, 11)


def test_snapshot_index_usable_blocks_does_not_refresh():
    idx = SnapshotIndex(2)
    idx.insert(1, 10)
    idx.insert(2, 20)
    assert idx.usable_blocks([1]) == 1
    assert idx.evict_oldest() == 10  # a match is not a use: setup's lookup is


def test_snapshot_index_of_capacity_zero_is_always_full():
    idx = SnapshotIndex(0)
    assert idx.full() and idx.usable_blocks([1, 2]) == 0


# -- RollbackRing ----------------------------------------------------------------------------------


def test_rollback_ring_push_beyond_depth_returns_the_oldest_slot():
    ring = RollbackRing(2)
    assert ring.push(7, 10, 100) is None
    assert ring.push(7, 12, 101) is None
    assert ring.push(7, 15, 102) == 100
    assert ring.entries(7) == [(12, 101), (15, 102)]
    assert ring.push(8, 3, 200) is None  # per sequence
    assert ring.num_entries() == 3
    with pytest.raises(AssertionError, match="increase"):
        ring.push(7, 15, 103)


def test_rollback_ring_best_at_or_before_drop_after_and_release():
    ring = RollbackRing(3)
    for cursor, slot in [(5, 50), (9, 90), (14, 140)]:
        ring.push(1, cursor, slot)
    assert ring.best_at_or_before(1, 4) is None
    assert ring.best_at_or_before(1, 5) == (5, 50)
    assert ring.best_at_or_before(1, 13) == (9, 90)
    assert ring.best_at_or_before(1, 100) == (14, 140)
    assert ring.best_at_or_before(2, 100) is None
    assert ring.drop_after(1, 9) == [140]  # an entry at the cursor itself stays
    assert ring.entries(1) == [(5, 50), (9, 90)]
    assert ring.drop_after(1, 100) == [] and ring.drop_after(2, 0) == []
    assert sorted(ring.release(1)) == [50, 90]
    assert ring.entries(1) == [] and ring.release(1) == [] and ring.num_entries() == 0


def test_rollback_ring_of_depth_zero_returns_every_push():
    ring = RollbackRing(0)
    assert ring.push(1, 3, 30) == 30 and ring.entries(1) == []


# -- StateLedger under a real scheduler -------------------------------------------------------------

BS = 4
VOCAB = 23


def fingerprint(tokens) -> tuple[float, float]:
    """What the fake layers keep after ``tokens``: their count and a position-weighted sum (exact in fp16)."""
    return float(len(tokens)), float(sum((i + 1) * t for i, t in enumerate(tokens)) % 997)


def write_state(pool: StatePool, slot: int, tokens) -> None:
    count, h = fingerprint(tokens)
    for i in pool.specs:
        pool.conv[i][slot].fill_(count)
        pool.recurrent[i][slot].fill_(h)


def read_state(pool: StatePool, slot: int) -> tuple[float, float]:
    values = set()
    for i in pool.specs:
        conv, rec = pool.conv[i][slot].float(), pool.recurrent[i][slot].float()
        assert bool((conv == conv.flatten()[0]).all()) and bool((rec == rec.flatten()[0]).all()), "a torn slot"
        values.add((float(conv.flatten()[0]), float(rec.flatten()[0])))
    assert len(values) == 1, f"the layers of slot {slot} disagree: {values}"
    return values.pop()


class Harness:
    """The engine's scheduler with its ledger (blocks and state slots), and a runner of its own: it
    carries out each plan's state copies on a real pool and plays a fake pool layer."""

    def __init__(self, *, max_seqs=3, snapshot_slots=2, ring_depth=1, num_blocks=24, budget=7, seed=0, prefix_caching=True):
        self.rng = random.Random(seed)
        self.blocks = BlockManager(num_blocks, BS, enable_prefix_caching=prefix_caching)
        config = StateConfig(max_seqs=max_seqs, snapshot_slots=snapshot_slots, ring_depth=ring_depth)
        self.states = StateLedger(config, self.blocks, has_pool=True)
        self.pool = StatePool(dict(SPECS), config.num_slots)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, max_model_len=200),
            CacheLedger(self.blocks, self.states), boundaries=self,
        )
        self.seqs: list[Sequence] = []
        self.prefixes = [[self.rng.randrange(VOCAB) for _ in range(13)] for _ in range(2)]
        self.ring_pushes = 0
        self.rollbacks = 0

    def before(self, seq, position) -> bool:
        # Boundary tokens are those divisible by 3. (The ledger does not take a second entry at a
        # position its ring already holds, the cursor a rollback restored.)
        hit = seq.token_at(position) % 3 == 0
        self.ring_pushes += hit
        return hit

    # -- operations
    def add(self, prefix: int, suffix: int, max_tokens: int) -> None:
        prompt = (self.prefixes[prefix] if prefix < 2 else []) + [self.rng.randrange(VOCAB) for _ in range(suffix)]
        seq = Sequence(prompt or [1], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
        self.scheduler.add(seq)
        self.seqs.append(seq)

    def step(self) -> None:
        plan = self.scheduler.schedule()
        if plan.empty:
            assert not self.scheduler.running
            return
        self.run(plan)

    def run(self, plan) -> None:
        self.pool.apply(plan.state_copies)
        for chunk in plan.chunks:  # the fake layer: read the live state, capture, write it back
            seq, tokens = chunk.seq, chunk.seq.token_ids
            live = plan.state_slots[seq.seq_id]
            assert live == self.states.live[seq.seq_id]
            assert read_state(self.pool, live) == fingerprint(tokens[: chunk.start]), (seq, chunk)
            captures = plan.captures.get(seq.seq_id, ())
            rows = [r for r, _ in captures]
            assert rows == sorted(rows) and all(1 <= r <= chunk.num_tokens for r in rows)
            for row, slot in captures:
                assert slot != live and slot != self.pool.pad_slot
                write_state(self.pool, slot, tokens[: chunk.start + row])
            write_state(self.pool, live, tokens[: chunk.start + chunk.num_tokens])
        sampled = {c.seq.seq_id: self.rng.randrange(VOCAB) for c in plan.chunks if c.samples}
        self.scheduler.update(plan, sampled)

    def abort(self, k: int) -> None:
        live = [s for s in self.seqs if not s.finished]
        if live:
            self.scheduler.abort(live[k % len(live)])

    def rollback(self, k: int, frac: float) -> None:
        cands = [s for s in self.seqs if s.status is Status.RUNNING and s.output_token_ids]
        if not cands:
            return
        seq = cands[k % len(cands)]
        position = len(seq.prompt_token_ids) + int(frac * len(seq.output_token_ids))
        before = seq.num_cached
        self.scheduler.rollback_to_boundary(seq, position)
        self.pool.apply(self.states.take_orders()[0])  # a runner would carry it out with the next plan
        self.rollbacks += 1
        assert seq.num_cached <= min(position - 1, before)
        assert len(seq) == position

    # -- checks
    def serial_tokens(self) -> dict[int, list[int]]:
        """Every reachable prefix-index node's serial -> the tokens of its whole chain of blocks."""
        by_serial = {n.serial: n for n in self.blocks._nodes.values()}
        out = {}
        for serial, node in by_serial.items():
            tokens = list(node.tokens)
            while node is not None and node.parent >= 0:
                node = by_serial.get(node.parent)  # None: a parent was evicted, the chain is unreachable
                if node is not None:
                    tokens[:0] = node.tokens
            if node is not None:
                out[serial] = tokens
        return out

    def check(self) -> None:
        self.states.check_invariants()
        self.blocks.check_invariants()
        for seq in self.seqs:
            if seq.seq_id in self.states.live:  # the invariant: the state after exactly num_cached tokens
                assert seq.status is Status.RUNNING
                assert read_state(self.pool, self.states.live[seq.seq_id]) == fingerprint(seq.token_ids[: seq.num_cached])
            else:
                assert seq.status is not Status.RUNNING, "a running sequence without a live slot"
                assert not self.states.ring.entries(seq.seq_id), "ring entries of a released sequence"
            for cursor, slot in self.states.ring.entries(seq.seq_id):
                assert cursor <= seq.num_cached  # entries past the cursor were dropped by the rewind
                assert read_state(self.pool, slot) == fingerprint(seq.token_ids[:cursor])
        chains = self.serial_tokens()
        for serial, slot in list(self.states.snapshots._slots.items()):
            if serial in chains:  # an unreachable snapshot only waits for LRU eviction
                assert read_state(self.pool, slot) == fingerprint(chains[serial]), serial
        assert not self.states._pending, "captures left pending after a step"

    def drain(self) -> None:
        for _ in range(2000):
            if not self.scheduler.has_unfinished():
                break
            self.step()
            self.check()
        assert not self.scheduler.has_unfinished()
        assert self.states.live == {} and self.states.ring.num_entries() == 0
        used = self.states.slots.num_slots - self.states.slots.num_free()
        assert used == len(self.states.snapshots), "only prefix snapshots may outlive their sequences"


OPS = st.one_of(
    st.tuples(st.just("add"), st.integers(0, 2), st.integers(0, 14), st.integers(1, 9)),
    st.tuples(st.just("step"), st.integers(1, 4)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
    st.tuples(st.just("rollback"), st.integers(0, 50), st.floats(0, 1)),
)


def run_ops(h: Harness, ops) -> None:
    for op in ops:
        if op[0] == "add":
            h.add(*op[1:])
        elif op[0] == "step":
            for _ in range(op[1]):
                h.step()
                h.check()
        elif op[0] == "abort":
            h.abort(op[1])
        else:
            h.rollback(op[1], op[2])
        h.check()
    h.drain()


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    ops=st.lists(OPS, max_size=40),
    config=st.tuples(st.integers(1, 4), st.integers(0, 3), st.integers(0, 2), st.integers(12, 40), st.integers(1, 9)),
    seed=st.integers(0, 2**16),
)
def test_state_ledger_random_workloads_keep_every_slot_owned_once_and_correct(ops, config, seed):
    max_seqs, snapshot_slots, ring_depth, num_blocks, budget = config
    h = Harness(
        max_seqs=max_seqs, snapshot_slots=snapshot_slots, ring_depth=ring_depth, num_blocks=num_blocks, budget=budget, seed=seed
    )
    run_ops(h, ops)


@pytest.mark.parametrize("seed", range(6))
def test_state_ledger_long_random_run_hits_snapshots_rings_and_preemption(seed):
    """Longer runs than hypothesis draws, with the counters showing each path was taken."""
    rng = random.Random(seed)
    h = Harness(max_seqs=3, snapshot_slots=3, ring_depth=2, num_blocks=12, budget=6, seed=seed)
    ops = []
    for _ in range(120):
        r = rng.random()
        if r < 0.25:
            ops.append(("add", rng.randrange(3), rng.randrange(15), rng.randrange(1, 10)))
        elif r < 0.85:
            ops.append(("step", rng.randrange(1, 4)))
        elif r < 0.9:
            ops.append(("abort", rng.randrange(50)))
        else:
            ops.append(("rollback", rng.randrange(50), rng.random()))
    run_ops(h, ops)
    assert h.states.snapshots_taken > 0 and h.states.snapshot_hits > 0
    assert h.ring_pushes > 0 and h.rollbacks > 0


def test_state_ledger_under_preemption():
    h = Harness(max_seqs=3, snapshot_slots=2, ring_depth=1, num_blocks=8, budget=5, seed=11)
    for prefix in (0, 0, 1):
        h.add(prefix, 2, 9)  # 15-token prompts growing to 24: three need 18 blocks of the 8
    run_ops(h, [("step", 1)] * 60)
    assert h.scheduler.num_preemptions > 0
    assert all(len(s.output_token_ids) == 9 for s in h.seqs)


def test_state_ledger_without_prefix_caching_never_snapshots():
    h = Harness(prefix_caching=False, snapshot_slots=4, seed=5)
    for _ in range(3):
        h.add(0, 6, 5)
    run_ops(h, [("step", 4)] * 10)
    assert h.states.snapshots_taken == 0 and h.states.snapshot_hits == 0 and len(h.states.snapshots) == 0


def test_prefix_snapshot_is_taken_at_the_capture_point_and_resumed_from():
    h = Harness(max_seqs=2, snapshot_slots=4, ring_depth=0, num_blocks=32, budget=5)
    prompt = list(range(1, 15))  # 14 tokens: capture point (14 - 1) // 4 * 4 = 12
    first = Sequence(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    assert h.states.prefix_capture_point(first) == 12
    h.scheduler.add(first)
    h.seqs.append(first)
    h.drain()
    # chunks of 5: [0,5) [5,10) [10,14): snapshots at chunk ends on block boundaries below the
    # capture point (none: 5 and 10 are not multiples of 4) and at the capture point 12 (in-chunk)
    assert h.states.snapshots_taken == 1 and len(h.states.snapshots) == 1
    second = Sequence(prompt[:12] + [20, 21, 22], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    h.scheduler.add(second)
    h.seqs.append(second)
    plan = h.scheduler.schedule()
    assert plan.prefills[0].start == 12  # resumed from the snapshot, not from a block boundary below
    assert h.states.snapshot_hits == 1
    h.run(plan)  # its first check: the live slot holds the snapshot's state, prompt[:12]
    h.drain()
    assert second.num_cached == 0 and len(second.output_token_ids) == 2



def test_a_match_is_cut_to_the_deepest_snapshot():
    blocks = BlockManager(16, BS)
    states = StateLedger(StateConfig(max_seqs=2, snapshot_slots=2), blocks, has_pool=True)
    cache = CacheLedger(blocks, states)  # the scheduler's view: matches cut to the state's snapshots
    tokens = list(range(1, 18))
    blocks.allocate(0, tokens, len(tokens))
    blocks.commit(0, tokens, len(tokens))
    assert blocks.match_prefix(tokens + [99]) == 4 * BS  # four cached blocks
    assert cache.match(tokens + [99]) == 0  # but no snapshot
    serials = blocks.prefix_serials(0)
    states.snapshots.insert(serials[1], states.slots.allocate())
    assert cache.match(tokens + [99]) == 2 * BS
    assert states.usable_prefix_blocks(serials) == 2


def test_release_frees_live_ring_and_pending_slots():
    blocks = BlockManager(16, BS)
    states = StateLedger(StateConfig(max_seqs=2, snapshot_slots=2, ring_depth=2), blocks, has_pool=True)
    slots = states.slots
    seq = Sequence(list(range(1, 11)), SamplingParams(max_tokens=3))
    blocks.allocate(seq.seq_id, seq.token_ids, 11)
    states.setup(seq, 0)
    live = states.live[seq.seq_id]
    assert states.take_orders() == ((StateCopy(None, live),), ())  # a fresh sequence's state is zeroed
    caps = states.plan_captures(Chunk(seq, 0, 10))
    assert [r for r, _ in caps] == [8]  # the capture point of a 10-token prompt with blocks of 4
    states.check_invariants()
    # ring entries before boundary tokens fed one at a time: a copy of the live slot before each
    for cursor in (10, 11, 12):
        assert states.plan_captures(Chunk(seq, cursor, 1), before_boundary=True) == []
        (copy,), _ = states.take_orders()
        assert copy.src == live and copy.dst == states.ring.entries(seq.seq_id)[-1][1]
        states.check_invariants()
    assert [c for c, _ in states.ring.entries(seq.seq_id)] == [11, 12]  # depth 2: the oldest was freed
    assert slots.num_slots - slots.num_free() == 1 + 1 + 2  # live, pending capture, ring
    states.free(seq)
    states.check_invariants()
    assert states.live == {} and states._pending == [] and states.ring.entries(seq.seq_id) == []
    assert slots.num_free() == slots.num_slots
    states.free(seq)  # idempotent
    assert slots.num_free() == slots.num_slots


def test_ring_entry_at_a_restored_cursor_when_the_boundary_token_is_fed_again():
    """The loop watchdog's pattern: rewind to just after a boundary token; the token is fed again."""
    h = Harness(max_seqs=1, snapshot_slots=0, ring_depth=2, seed=1)
    h.add(2, 5, 8)  # a 5-token prompt, no shared prefix
    (seq,) = h.seqs
    P = 5 + 5  # token P - 1 = 9 sits in the block [8, 12), not full yet, so the KV cursor can stop there
    h.before = lambda s, pos: pos == P - 1  # the scheduler asks about the token, each time it is fed
    while len(seq.output_token_ids) < 6:
        h.step()
    h.scheduler.rollback_to_boundary(seq, P)
    h.pool.apply(h.states.take_orders()[0])
    if seq.num_cached != P - 1:
        pytest.fail(f"expected a restore from the ring at {P - 1}, got {seq.num_cached}")
    h.check()
    h.step()  # feeds token P - 1 again
    h.check()
    h.drain()
