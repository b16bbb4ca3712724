"""The device-free block manager: block tables, prefix cache, LRU eviction, rewind and fork."""

import random

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from layerzoo.runtime import block_manager as bm_module
from layerzoo.runtime.block_manager import BlockManager

BS = 4


def run_seq(bm: BlockManager, seq_id: int, tokens: list[int]) -> int:
    """Admit a sequence, compute all of its tokens and commit them; returns the cached tokens reused."""
    cursor = bm.allocate(seq_id, tokens, len(tokens))
    bm.commit(seq_id, tokens, len(tokens))
    bm.check_invariants()
    return cursor


def test_fresh_allocation_and_free():
    bm = BlockManager(8, BS)
    assert bm.block_size == BS and bm.num_free_blocks() == 8
    assert bm.allocate(0, list(range(9)), 9) == 0
    assert bm.block_table(0) == [0, 1, 2] and bm.has_sequence(0)
    assert bm.num_free_blocks() == 5
    bm.block_table(0).append(99)  # a copy
    assert bm.block_table(0) == [0, 1, 2]
    bm.free_sequence(0)
    bm.check_invariants()
    assert not bm.has_sequence(0) and bm.num_free_blocks() == 8


def test_prefix_hit_after_a_finished_sequence():
    bm = BlockManager(8, BS)
    prompt = list(range(10))
    run_seq(bm, 0, prompt)
    bm.free_sequence(0)
    assert bm.match_prefix(prompt) == 8
    assert bm.match_prefix(prompt[:8] + [99, 98]) == 8
    assert bm.match_prefix([99] + prompt[1:]) == 0
    assert run_seq(bm, 1, prompt + [50]) == 8
    assert bm.block_table(1)[:2] == [0, 1]


def test_partial_blocks_are_never_matched():
    bm = BlockManager(8, BS)
    run_seq(bm, 0, list(range(7)))  # one full block, one partial
    bm.free_sequence(0)
    assert bm.match_prefix(list(range(20))) == 4


def test_the_last_token_is_never_cached():
    bm = BlockManager(8, BS)
    prompt = list(range(8))
    run_seq(bm, 0, prompt)
    bm.free_sequence(0)
    assert bm.match_prefix(prompt) == 4  # both blocks cached, but the last token must be computed
    assert bm.match_prefix(prompt + [8]) == 8
    assert bm.match_prefix(prompt[:1]) == 0 and bm.match_prefix([]) == 0


def test_match_prefix_is_pure():
    bm = BlockManager(4, BS)
    run_seq(bm, 0, list(range(9)))
    bm.free_sequence(0)
    before = (bm.num_free_blocks(), bm.prefix_hits, bm.prefix_queries)
    assert bm.match_prefix(list(range(9))) == 8
    assert (bm.num_free_blocks(), bm.prefix_hits, bm.prefix_queries) == before


def test_commit_registers_only_computed_full_blocks_and_is_idempotent():
    bm = BlockManager(8, BS)
    tokens = list(range(12))
    bm.allocate(0, tokens, 12)
    bm.commit(0, tokens, 7)
    assert bm.match_prefix(tokens) == 4
    bm.commit(0, tokens, 7)
    bm.commit(0, tokens, 3)
    bm.check_invariants()
    bm.commit(0, tokens, 12)
    assert bm.match_prefix(tokens + [0]) == 12


def test_same_prefix_computed_twice_keeps_the_first_entry():
    bm = BlockManager(8, BS)
    tokens = list(range(9))
    bm.allocate(0, tokens, 9)
    bm.allocate(1, tokens, 9)  # admitted before 0 committed: no hit
    assert bm.block_table(1) == [3, 4, 5]
    bm.commit(0, tokens, 9)
    bm.commit(1, tokens, 9)
    bm.check_invariants()
    bm.free_sequence(1)  # its blocks were never registered: back to the free list
    assert bm.num_free_blocks() == 5 and bm.match_prefix(tokens) == 8
    bm.free_sequence(0)
    bm.check_invariants()
    assert run_seq(bm, 2, tokens) == 8 and bm.block_table(2)[:2] == [0, 1]


def test_evictable_blocks_count_as_free_and_leave_the_lru_on_a_hit():
    bm = BlockManager(3, BS)
    prompt = list(range(9))
    run_seq(bm, 0, prompt)
    bm.free_sequence(0)
    assert bm.num_free_blocks() == 3
    assert bm.can_allocate(prompt, 9)  # 2 cached + 1 fresh
    assert not bm.can_allocate(prompt, 13)  # the 2 hits are not free for the fresh blocks
    assert bm.allocate(1, prompt, 9) == 8
    bm.check_invariants()
    assert bm.num_free_blocks() == 0 and bm.block_table(1)[:2] == [0, 1]


def test_eviction_is_least_recently_freed_first_and_forgets_the_block():
    bm = BlockManager(4, BS)
    a, b = [1] * 5, [2] * 5
    run_seq(bm, 0, a)  # blocks 0, 1
    run_seq(bm, 1, b)  # blocks 2, 3
    bm.free_sequence(0)  # 1 (partial) -> free list, 0 -> evictable
    bm.free_sequence(1)  # 3 -> free list, 2 -> evictable (more recent)
    assert bm.num_free_blocks() == 4
    bm.allocate(2, [3] * 12, 12)  # free list first (1, 3), then evicts 0, the oldest
    assert bm.block_table(2) == [1, 3, 0]
    bm.check_invariants()
    assert bm.match_prefix(a) == 0  # its entry went with the block
    assert bm.match_prefix(b) == 4


def test_a_sequence_is_freed_tail_first():
    bm = BlockManager(4, BS)
    run_seq(bm, 0, list(range(13)))  # blocks 0, 1, 2 registered, 3 partial
    bm.free_sequence(0)  # LRU: 2, 1, 0
    bm.allocate(1, [99] * 9, 9)
    assert bm.block_table(1) == [3, 2, 1]
    assert bm.match_prefix(list(range(13))) == 4  # the root block outlives its children


def test_collision_safety_with_a_constant_hash(monkeypatch):
    monkeypatch.setattr(bm_module, "_hash_block", lambda parent, tokens: 7)
    bm = BlockManager(16, BS)
    a = [1, 1, 1, 1, 1, 1, 1, 1, 5]
    run_seq(bm, 0, a)  # block 0 registered; block 1 collides with it (same key, another parent)
    bm.free_sequence(0)
    assert bm.match_prefix(a) == 4
    assert bm.match_prefix([2] * 9) == 0  # same hash, other tokens
    assert run_seq(bm, 1, [2] * 9) == 0
    assert bm.match_prefix([1] * 4 + [1] * 4 + [9]) == 4  # the second block is not the first one
    bm.free_sequence(1)
    bm.check_invariants()


def test_a_chain_collision_cannot_match_a_block_of_another_prefix(monkeypatch):
    monkeypatch.setattr(bm_module, "_hash_block", lambda parent, tokens: hash(tokens))  # ignores the parent
    bm = BlockManager(8, BS)
    run_seq(bm, 0, [1] * 4 + [2] * 4 + [0])
    run_seq(bm, 1, [3] * 4 + [2] * 4 + [0])  # its second block has the key of seq 0's second block
    bm.free_sequence(0)
    bm.free_sequence(1)
    bm.check_invariants()
    assert bm.match_prefix([1] * 4 + [2] * 4 + [0]) == 8
    assert bm.match_prefix([3] * 4 + [2] * 4 + [0]) == 4  # same tokens, another parent


def test_rewind_inside_a_private_block_keeps_it():
    bm = BlockManager(8, BS)
    tokens = list(range(10))
    bm.allocate(0, tokens, 10)
    bm.commit(0, tokens, 10)
    assert bm.rewind(0, 9) == 9 and bm.block_table(0) == [0, 1, 2]
    assert bm.rewind(0, 8) == 8 and bm.block_table(0) == [0, 1]
    bm.check_invariants()
    assert bm.num_free_blocks() == 6


def test_rewind_inside_a_registered_block_returns_the_boundary():
    bm = BlockManager(8, BS)
    tokens = list(range(10))
    bm.allocate(0, tokens, 10)
    bm.commit(0, tokens, 10)
    assert bm.rewind(0, 6) == 4 and bm.block_table(0) == [0]
    bm.check_invariants()
    assert bm.match_prefix(tokens) == 8  # block 1 is evictable, still cached
    bm.append(0, 10)
    assert bm.block_table(0) == [0, 2, 3]  # fresh blocks (the lowest free ids), not the cached block 1
    bm.commit(0, tokens, 10)
    bm.check_invariants()


def test_rewind_inside_a_shared_block_returns_the_boundary():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    bm.allocate(0, list(range(9)), 9)
    assert bm.fork(0, 1, 9) == 8
    assert bm.rewind(1, 6) == 4 and bm.block_table(1) == [0]
    assert bm.rewind(0, 6) == 6 and bm.block_table(0) == [0, 1]  # no longer shared
    bm.check_invariants()


def test_rewind_to_a_boundary_and_to_zero():
    bm = BlockManager(8, BS)
    tokens = list(range(12))
    bm.allocate(0, tokens, 12)
    bm.commit(0, tokens, 12)
    assert bm.rewind(0, 8) == 8 and bm.block_table(0) == [0, 1]
    assert bm.rewind(0, 0) == 0 and bm.block_table(0) == []
    bm.check_invariants()
    bm.free_sequence(0)
    assert bm.num_free_blocks() == 8


def test_fork_shares_only_full_blocks():
    bm = BlockManager(8, BS)
    prompt = list(range(10))
    bm.allocate(0, prompt, 10)
    bm.commit(0, prompt, 10)
    assert bm.fork(0, 1, 10) == 8
    assert bm.block_table(1) == [0, 1]
    bm.append(1, 11)
    assert bm.block_table(1) == [0, 1, 3]
    bm.check_invariants()
    bm.free_sequence(0)
    bm.check_invariants()
    assert bm.block_table(1) == [0, 1, 3]
    bm.free_sequence(1)
    bm.check_invariants()
    assert bm.num_free_blocks() == 8


def test_fork_of_a_short_prompt_shares_nothing():
    bm = BlockManager(8, BS)
    bm.allocate(0, [1, 2, 3], 3)
    assert bm.fork(0, 1, 3) == 0 and bm.block_table(1) == []
    bm.check_invariants()


def test_caching_off_never_matches():
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    prompt = list(range(10))
    run_seq(bm, 0, prompt)
    bm.free_sequence(0)
    assert bm.match_prefix(prompt) == 0
    assert run_seq(bm, 1, prompt) == 0
    assert bm.prefix_hits == 0 and bm.prefix_queries == 0
    bm.free_sequence(1)
    assert bm.num_free_blocks() == 8


def test_hit_counters_count_blocks_in_allocate_only():
    bm = BlockManager(16, BS)
    prompt = list(range(13))  # 12 tokens eligible: 3 blocks queried
    run_seq(bm, 0, prompt)
    assert (bm.prefix_queries, bm.prefix_hits) == (3, 0)
    bm.match_prefix(prompt)
    assert (bm.prefix_queries, bm.prefix_hits) == (3, 0)
    bm.allocate(1, prompt[:9] + [0, 0, 0, 0], 13)  # blocks 0, 1 hit, block 2 misses
    assert (bm.prefix_queries, bm.prefix_hits) == (6, 2)


def test_can_append_and_append():
    bm = BlockManager(3, BS)
    bm.allocate(0, [1, 2], 2)
    assert bm.can_append(0, 4) and bm.can_append(0, 12) and not bm.can_append(0, 13)
    bm.append(0, 4)
    assert bm.block_table(0) == [0]
    bm.append(0, 5)
    assert bm.block_table(0) == [0, 1]
    bm.check_invariants()


def test_programmer_errors_assert():
    bm = BlockManager(2, BS)
    bm.allocate(0, [1], 1)
    with pytest.raises(AssertionError):
        bm.allocate(0, [1], 1)
    with pytest.raises(AssertionError):
        bm.allocate(1, [1] * 12, 12)  # cannot allocate
    bm.free_sequence(0)
    with pytest.raises(AssertionError):
        bm.free_sequence(0)
    with pytest.raises((AssertionError, KeyError)):
        bm.append(5, 4)


def random_ops(bm: BlockManager, seed: int) -> list:
    """A seeded mix of allocate, commit, append, rewind, fork and free; returns every table seen."""
    rng, live, trace, next_id = random.Random(seed), {}, [], 0
    for _ in range(300):
        op = rng.random()
        if op < 0.3 or not live:
            tokens = [rng.randrange(2) for _ in range(rng.randrange(1, 14))]
            if bm.can_allocate(tokens, len(tokens)):
                bm.allocate(next_id, tokens, len(tokens))
                bm.commit(next_id, tokens, len(tokens))
                live[next_id] = tokens
                next_id += 1
        else:
            seq_id = rng.choice(sorted(live))
            tokens = live[seq_id]
            if op < 0.6 and bm.can_append(seq_id, len(tokens) + 3):
                tokens += [rng.randrange(2) for _ in range(3)]
                bm.append(seq_id, len(tokens))
                bm.commit(seq_id, tokens, len(tokens))
            elif op < 0.7:
                live[seq_id] = tokens[: bm.rewind(seq_id, rng.randrange(len(tokens) + 1))]
            elif op < 0.8:
                live[next_id] = tokens[: bm.fork(seq_id, next_id, len(tokens))]
                next_id += 1
            else:
                bm.free_sequence(seq_id)
                del live[seq_id]
        trace.append(sorted((s, bm.block_table(s)) for s in live))
    return trace


def test_a_sequence_growing_alone_takes_one_run_of_ids():
    """Free blocks are handed out lowest id first, so a long prompt after others finished gets
    consecutive blocks in order (the CPU prefill then reads its prefix in place), whatever order
    the earlier sequences freed theirs in."""
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    bm.allocate(0, list(range(3 * BS)), 3 * BS)
    bm.allocate(1, list(range(2 * BS)), 2 * BS)
    bm.free_sequence(0)
    bm.free_sequence(1)
    bm.allocate(2, list(range(BS)), BS)
    for tokens in range(2 * BS, 5 * BS + 1, BS):  # grows chunk by chunk
        bm.append(2, tokens)
    assert bm.block_table(2) == [0, 1, 2, 3, 4]
    bm.check_invariants()


def test_allocation_order_is_deterministic():
    runs = [random_ops(BlockManager(24, BS), seed=1234) for _ in range(2)]
    assert runs[0] == runs[1]
    bm = BlockManager(6, BS)
    bm.allocate(0, [1] * 9, 9)
    bm.commit(0, [1] * 9, 9)
    bm.allocate(1, [2] * 5, 5)
    bm.free_sequence(0)
    bm.allocate(2, [1] * 9, 9)  # hits 0 and 1, then the lowest free id: 2 (freed later) before 5
    bm.allocate(3, [3] * 3, 3)
    assert [bm.block_table(s) for s in (1, 2, 3)] == [[3, 4], [0, 1, 2], [5]]


# -- property-based: random admissions, steps, frees, preemptions, rewinds and forks

NUM_BLOCKS = 12

def bits(value: int, n: int) -> list[int]:
    return [(value >> i) & 1 for i in range(n)]


# a shared system prompt (so prefixes repeat) and 1-12 tokens of a binary alphabet, drawn as one int
PROMPTS = st.builds(
    lambda head, n, value: list(head) + bits(value, n),
    st.sampled_from([(), (0,) * 8, (1, 0) * 4]), st.integers(1, 12), st.integers(0, 2**12 - 1),
)


class BlockManagerMachine(RuleBasedStateMachine):
    """Drives a BlockManager and a fake KV pool: every computed position holds the token prefix that
    produced it, so a wrong prefix hit, an overwritten shared block or a leaked block shows up."""

    caching = True

    def __init__(self):
        super().__init__()
        self.bm = BlockManager(NUM_BLOCKS, BS, enable_prefix_caching=self.caching)
        self.seqs: dict[int, list] = {}  # seq_id -> [tokens, KV cursor]
        self.preempted: list[list[int]] = []
        self.pool: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> the prefix whose KV is there
        self.next_id = 0

    def new_id(self) -> int:
        self.next_id += 1
        return self.next_id - 1

    def compute(self, seq_id: int, upto: int) -> None:
        tokens, cursor = self.seqs[seq_id]
        table = self.bm.block_table(seq_id)
        for p in range(cursor, upto):
            block = table[p // BS]
            assert self.bm._ref[block] == 1 and block not in self.bm._nodes, "a write into a shared or cached block"
            self.pool[block, p % BS] = tuple(tokens[: p + 1])
        self.bm.commit(seq_id, tokens, upto)
        self.seqs[seq_id][1] = upto

    def admit(self, tokens: list[int], chunk: int) -> None:
        cursor = self.bm.match_prefix(tokens)
        assert cursor % BS == 0 and cursor <= len(tokens) - 1
        n = min(chunk, len(tokens) - cursor)
        if not self.bm.can_allocate(tokens, cursor + n):
            return
        seq_id = self.new_id()
        assert self.bm.allocate(seq_id, tokens, cursor + n) == cursor
        self.seqs[seq_id] = [list(tokens), cursor]
        self.compute(seq_id, cursor + n)

    def pick(self, data) -> int:
        return data.draw(st.sampled_from(sorted(self.seqs)))

    @rule(tokens=PROMPTS, chunk=st.integers(1, 16))
    def add(self, tokens, chunk):
        self.admit(tokens, chunk)

    @rule(tokens=PROMPTS)
    def add_then_abort(self, tokens):  # blocks taken, nothing computed
        cursor = self.bm.match_prefix(tokens)
        if self.bm.can_allocate(tokens, len(tokens)):
            seq_id = self.new_id()
            assert self.bm.allocate(seq_id, tokens, len(tokens)) == cursor
            self.bm.free_sequence(seq_id)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data(), k=st.integers(1, 5), generated=st.integers(0, 31))
    def step(self, data, k, generated):
        seq_id = self.pick(data)
        tokens, cursor = self.seqs[seq_id]
        tokens.extend(bits(generated, max(0, cursor + k - len(tokens))))
        if self.bm.can_append(seq_id, cursor + k):
            self.bm.append(seq_id, cursor + k)
            self.compute(seq_id, cursor + k)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def finish_or_abort(self, data):
        seq_id = self.pick(data)
        self.bm.free_sequence(seq_id)
        del self.seqs[seq_id]

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def preempt(self, data):
        seq_id = self.pick(data)
        self.bm.free_sequence(seq_id)
        tokens, _ = self.seqs.pop(seq_id)
        if tokens:
            self.preempted.append(tokens)

    @precondition(lambda self: self.preempted)
    @rule(chunk=st.integers(1, 16))
    def resume(self, chunk):
        self.admit(self.preempted.pop(0), chunk)

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def rewind(self, data):
        seq_id = self.pick(data)
        tokens, cursor = self.seqs[seq_id]
        num_tokens = data.draw(st.integers(0, cursor))
        new_cursor = self.bm.rewind(seq_id, num_tokens)
        assert new_cursor == num_tokens or new_cursor == num_tokens // BS * BS
        del tokens[num_tokens:]  # drafts dropped; [new_cursor, num_tokens) is recomputed
        self.seqs[seq_id][1] = new_cursor
        assert len(self.bm.block_table(seq_id)) == -(-num_tokens // BS) or new_cursor % BS == 0

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def fork(self, data):
        parent = self.pick(data)
        tokens, cursor = self.seqs[parent]
        num_tokens = data.draw(st.integers(0, cursor))
        child = self.new_id()
        assert self.bm.fork(parent, child, num_tokens) == num_tokens // BS * BS
        self.seqs[child] = [tokens[:num_tokens], num_tokens // BS * BS]

    @invariant()
    def consistent(self):
        self.bm.check_invariants()
        for seq_id, (tokens, cursor) in self.seqs.items():
            table = self.bm.block_table(seq_id)
            assert cursor <= len(table) * BS and cursor <= len(tokens)
            for block in table[cursor // BS :]:  # where the next tokens go: private and not cached
                assert self.bm._ref[block] == 1 and block not in self.bm._nodes
            for p in range(cursor):
                assert self.pool.get((table[p // BS], p % BS)) == tuple(tokens[: p + 1]), "wrong KV at a position"

    def teardown(self):
        for seq_id in list(self.seqs):
            self.bm.free_sequence(seq_id)
        self.bm.check_invariants()
        assert self.bm._ref == [0] * NUM_BLOCKS
        assert self.bm.num_free_blocks() == NUM_BLOCKS
        assert self.bm.can_allocate([7] * (NUM_BLOCKS * BS), NUM_BLOCKS * BS)


class NoCachingMachine(BlockManagerMachine):
    caching = False


MACHINE_SETTINGS = settings(
    max_examples=150, stateful_step_count=40, deadline=None, database=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)


def test_random_operations_keep_the_invariants():
    run_state_machine_as_test(BlockManagerMachine, settings=MACHINE_SETTINGS)


def test_random_operations_without_caching():
    run_state_machine_as_test(NoCachingMachine, settings=settings(MACHINE_SETTINGS, max_examples=50))


def test_random_operations_under_heavy_hash_collisions(monkeypatch):
    monkeypatch.setattr(bm_module, "_hash_block", lambda parent, tokens: (parent + sum(tokens)) % 3)
    run_state_machine_as_test(BlockManagerMachine, settings=settings(MACHINE_SETTINGS, max_examples=50))
