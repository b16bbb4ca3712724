"""The scheduler on CPU with no model: planning, budgets, preemption, stops, abort, rollback.

A fake "model" stands in for the step: it samples a token derived from the sequence's tokens, so
outputs depend only on each sequence's own history, the way a real model's do.
"""

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from layerzoo.errors import LayerStateNotRewindable, SchedulerStalled
from layerzoo.plugins.capabilities import LayerCapabilities, ModelCapabilities
from layerzoo.runtime.block_manager import BlockManager
from layerzoo.runtime.cache_ledger import CacheLedger
from layerzoo.runtime.scheduler import Scheduler, SchedulerConfig
from layerzoo.runtime.sequence import FinishReason, Sequence, Status
from layerzoo.runtime.state_ledger import StateConfig, StateLedger
from layerzoo.sampling import SamplingParams

EOS = 0


def fake_token(seq: Sequence) -> int:
    """A deterministic function of the sequence's own tokens (never EOS unless asked)."""
    return 1 + (sum(seq.token_ids) * 31 + len(seq)) % 50


def make(num_blocks=32, block_size=4, caps=None, **config):
    blocks = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(**config), CacheLedger(blocks), caps, eos_token_ids=[EOS])


def step(scheduler: Scheduler):
    plan = scheduler.schedule()
    sampled = {c.seq.seq_id: fake_token(c.seq) for c in plan.chunks if c.samples}
    return plan, scheduler.update(plan, sampled)


def run(scheduler, seqs):
    for s in seqs:
        scheduler.add(s)
    while scheduler.has_unfinished():
        step(scheduler)
        scheduler.cache.blocks.check_invariants()
    return [s.output_token_ids for s in seqs]


def seq(n_prompt, max_tokens=6, start=1, **params):
    return Sequence([start + i % 40 for i in range(n_prompt)], SamplingParams(temperature=0, max_tokens=max_tokens, **params))


def test_decode_rows_come_first_and_the_budget_holds():
    s = make(max_num_batched_tokens=10)
    a, b = seq(3), seq(20, start=2)
    s.add(a), s.add(b)
    plan, _ = step(s)
    assert [c.seq for c in plan.prefills] == [a, b] and plan.num_tokens == 10  # b is chunked
    plan, _ = step(s)
    assert [c.seq for c in plan.decodes] == [a] and [c.num_tokens for c in plan.prefills] == [9]
    assert plan.num_tokens <= 10


def test_outputs_do_not_depend_on_budget_or_blocks():
    def workload():
        return [seq(n, max_tokens=m, start=n) for n, m in [(5, 20), (17, 12), (2, 25), (30, 5), (9, 16)]]

    expected = run(make(num_blocks=64, max_num_batched_tokens=512), workload())
    assert run(make(num_blocks=64, max_num_batched_tokens=3), workload()) == expected
    tight = make(num_blocks=10, max_num_batched_tokens=16)
    assert run(tight, workload()) == expected
    assert tight.num_preemptions > 0


def test_max_num_seqs_caps_running():
    s = make(max_num_seqs=2)
    for i in range(5):
        s.add(seq(3, start=i + 1))
    plan, _ = step(s)
    assert len(s.running) == 2 and len(plan.chunks) == 2


def step_forcing(scheduler, forced):
    """One step in which the sequences in ``forced`` (seq -> token) draw the given token."""
    plan = scheduler.schedule()
    sampled = {c.seq.seq_id: forced.get(c.seq, fake_token(c.seq)) for c in plan.chunks if c.samples}
    return scheduler.update(plan, sampled)


def test_stop_conditions():
    s = make()
    eos, ignored, stop_id = seq(3, max_tokens=50), seq(3, max_tokens=2, ignore_eos=True), seq(3, max_tokens=50, stop_token_ids=[7])
    for q in (eos, ignored, stop_id):
        s.add(q)
    step(s)
    finished = step_forcing(s, {eos: EOS, ignored: EOS, stop_id: 7})
    assert set(finished) == {eos, ignored, stop_id}
    assert eos.finish_reason is FinishReason.STOP and eos.stop_reason == EOS
    assert stop_id.finish_reason is FinishReason.STOP and stop_id.stop_reason == 7
    assert ignored.finish_reason is FinishReason.LENGTH  # EOS ignored; max_tokens=2 ended it
    min_tokens = seq(3, max_tokens=50, min_tokens=3)
    s.add(min_tokens)
    assert step_forcing(s, {min_tokens: EOS}) == []  # EOS before min_tokens does not stop
    assert len(run(make(max_model_len=10), [seq(6, max_tokens=100)])[0]) == 4


def test_abort_frees_everything_at_once():
    s = make()
    a, b = seq(9), seq(5, start=3)
    s.add(a), s.add(b)
    step(s)
    s.abort(a)
    assert a.finish_reason is FinishReason.ABORT and a not in s.running
    assert not s.cache.blocks.has_sequence(a.seq_id)
    run(s, [])
    assert s.cache.blocks.num_free_blocks() == s.cache.blocks.num_blocks


def test_rollback_to_boundary_rewinds_and_continues():
    s = make()
    a = seq(6, max_tokens=10)
    s.add(a)
    for _ in range(5):
        step(s)
    before = list(a.output_token_ids)
    s.rollback_to_boundary(a, len(a.prompt_token_ids) + 2)
    assert a.output_token_ids == before[:2] and a.num_cached <= len(a) - 1
    s.cache.blocks.check_invariants()
    run(s, [])
    # The fake model is a function of the history, so the same tokens come again.
    assert a.output_token_ids[:5] == before and len(a.output_token_ids) == 10


def test_rollback_declines_for_a_layer_that_cannot_rewind():
    layer = LayerCapabilities.of(3, "KimiLayer", "kimi.kda", "kimi", decode_rollback_unsupported=True)
    s = make(caps=ModelCapabilities((layer,)))
    a = seq(4)
    s.add(a)
    step(s), step(s)
    with pytest.raises(LayerStateNotRewindable, match="layer 3 .KimiLayer, answered by kimi"):
        s.rollback_to_boundary(a, 4)
    assert len(a.output_token_ids) == 2  # nothing changed


def test_chunking_off_runs_prompts_whole():
    layer = LayerCapabilities.of(0, "MlaLayer", "x.mla", "x", uses_local_mla_prefill=True)
    s = make(caps=ModelCapabilities((layer,)), max_num_batched_tokens=8)
    long, short = seq(20), seq(3, start=5)
    s.add(long), s.add(short)
    plan, _ = step(s)
    assert [c.num_tokens for c in plan.prefills] == [20]  # alone in the budget, but whole
    plan, _ = step(s)
    assert [c.num_tokens for c in plan.prefills] == [3]


class SchedulerMachine(RuleBasedStateMachine):
    """Random add / step / abort / rollback; blocks never leak or double-free."""

    def __init__(self):
        super().__init__()
        self.s = make(num_blocks=12, block_size=4, max_num_batched_tokens=9, max_num_seqs=4)
        self.all: list[Sequence] = []

    @rule(n=st.integers(1, 14), m=st.integers(1, 8), start=st.integers(1, 3))
    def add(self, n, m, start):
        sq = seq(n, max_tokens=m, start=start)
        self.all.append(sq)
        self.s.add(sq)

    @precondition(lambda self: self.s.has_unfinished())
    @rule()
    def step(self):
        step(self.s)

    @precondition(lambda self: any(not q.finished for q in self.all))
    @rule(data=st.data())
    def abort(self, data):
        live = [q for q in self.all if not q.finished]
        self.s.abort(data.draw(st.sampled_from(live)))

    @precondition(lambda self: any(q.status is Status.RUNNING and q.output_token_ids for q in self.all))
    @rule(data=st.data())
    def rollback(self, data):
        live = [q for q in self.all if q.status is Status.RUNNING and q.output_token_ids]
        q = data.draw(st.sampled_from(live))
        keep = data.draw(st.integers(0, len(q.output_token_ids)))
        self.s.rollback_to_boundary(q, len(q.prompt_token_ids) + keep)

    @invariant()
    def blocks_are_consistent(self):
        self.s.cache.blocks.check_invariants()
        for q in self.s.running:
            assert q.num_cached <= len(q)
            table = self.s.cache.blocks.block_table(q.seq_id)
            assert len(table) * self.s.cache.blocks.block_size >= q.num_cached

    def teardown(self):
        for _ in range(500):
            if not self.s.has_unfinished():
                break
            step(self.s)
        assert not self.s.has_unfinished()
        assert self.s.cache.blocks.num_free_blocks() == self.s.cache.blocks.num_blocks
        self.s.cache.blocks.check_invariants()


SchedulerMachine.TestCase.settings = settings(
    max_examples=int(os.environ.get("LAYERZOO_HYPOTHESIS_EXAMPLES", 60)), stateful_step_count=30, deadline=None,
    derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
test_scheduler_machine = SchedulerMachine.TestCase


def test_a_sequence_the_whole_cache_cannot_hold_finishes_instead_of_waiting_forever():
    s = make(num_blocks=3, block_size=4)  # 12 positions in all
    long, short = seq(6, max_tokens=20), seq(2, max_tokens=3)
    s.add(long)
    s.add(short)
    for _ in range(60):
        if not s.has_unfinished():
            break
        step(s)
    assert not s.has_unfinished()
    assert long.finish_reason is FinishReason.LENGTH and len(long) == 13  # the 12 positions the cache holds, and the token they gave
    assert short.finish_reason is FinishReason.LENGTH and len(short.output_token_ids) == 3
    s.cache.blocks.check_invariants()


class FixedDrafts:
    """A proposer drafting ``k`` copies of token 1 (never rejected here: the fake step samples
    one token per chunk, so every verify keeps one)."""

    def propose(self, token_ids, k):
        return [1] * k


def test_draft_rows_are_charged_to_the_step_budget():
    # Three decoding sequences with 3 drafts each would need 12 rows; the budget is 6.
    s = Scheduler(SchedulerConfig(max_num_batched_tokens=6), CacheLedger(BlockManager(64, 4)), eos_token_ids=[EOS],
                  proposer=FixedDrafts(), num_speculative_tokens=3)
    a, b, c = seq(2, max_tokens=40), seq(2, max_tokens=40, start=2), seq(2, max_tokens=40, start=3)
    for q in (a, b, c):
        s.add(q)
    plan, _ = step(s)
    assert len(plan.prefills) == 3  # the three prompts (6 tokens)
    for _ in range(6):
        plan, _ = step(s)
        assert plan.num_tokens <= 6, [(c.seq.seq_id, c.num_tokens) for c in plan.chunks]
        # the first in line gets its 3 drafts, the next what is left (1), the third no row
        assert [len(c.draft) for c in plan.decodes] == [3, 1] and len(plan.decodes) == 2
        s.cache.blocks.check_invariants()


def test_preemption_takes_the_newest_sequence():
    """As vLLM does: out of blocks, a decode preempts the most recently admitted sequence (the
    back of the running list), never an older one; the newest, short of room, preempts itself."""
    s = make(num_blocks=6, block_size=4)
    a, b, c = seq(3, max_tokens=20), seq(3, max_tokens=20, start=2), seq(3, max_tokens=20, start=3)
    for q in (a, b, c):
        s.add(q)
    preempted = []
    while not preempted:
        plan, _ = step(s)
        preempted = list(plan.preempted)
    # Each holds two blocks (up to 8 tokens); a needs a third first: c goes, a and b run on.
    assert preempted == [c] and c.status is Status.WAITING and c.num_cached == 0
    assert a.num_preemptions == b.num_preemptions == 0 and s.running == [a, b]
    assert [q.seq for q in plan.decodes] == [a, b]


def test_the_newest_sequence_short_of_room_preempts_itself():
    s = make(num_blocks=4, block_size=4)
    a, b = seq(3, max_tokens=20), seq(6, max_tokens=20, start=2)
    s.add(a), s.add(b)
    preempted = []
    while not preempted:
        plan, _ = step(s)
        preempted = list(plan.preempted)
    # b (newer) needs a third block when none is free; a, the only other one, is older: b goes.
    assert preempted == [b] and a.num_preemptions == 0 and s.running == [a]


def test_a_prompt_of_whole_blocks_is_snapshotted_where_its_repeat_resumes():
    """Hybrid models resume a prefix hit only at a state snapshot. A repeated prompt matches all
    its blocks but the one holding its last token, so the snapshot must be taken there, also for
    a prompt that fills its blocks exactly (8 tokens, blocks of 4: at 4, not at 8)."""
    for n in (7, 8, 9, 12):
        blocks = BlockManager(32, 4)
        states = StateLedger(StateConfig(max_seqs=4, snapshot_slots=4), blocks, has_pool=True)
        s = Scheduler(SchedulerConfig(), CacheLedger(blocks, states), eos_token_ids=[EOS])
        prompt = [5 + i for i in range(n)]
        run(s, [Sequence(prompt, SamplingParams(temperature=0, max_tokens=2))])
        again = Sequence(prompt, SamplingParams(temperature=0, max_tokens=2))
        s.add(again)
        plan = s.schedule()
        assert plan.prefills[0].start == (n - 1) // 4 * 4, n
        assert states.snapshot_hits == 1, n


def test_siblings_of_a_prompt_of_whole_blocks_start_while_the_first_runs():
    """n > 1: a sibling shares its parent's prompt blocks but the last token's, whose row it runs
    for its own first logits. With a prompt of exactly two blocks it used to share both, had no
    row left to run, and waited for the parent to finish."""
    s = make(block_size=4)
    params = SamplingParams(temperature=0, max_tokens=10)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    first = Sequence(prompt, params)
    second = Sequence(prompt, params, index=1, parent=first)
    s.add(first), s.add(second)
    step(s)  # the parent's prompt; the sibling waits for it to be cached
    plan, _ = step(s)
    (chunk,) = plan.prefills
    assert chunk.seq is second and (chunk.start, chunk.num_tokens) == (4, 4) and not first.finished
    assert s.cache.blocks.block_table(second.seq_id)[0] == s.cache.blocks.block_table(first.seq_id)[0]


def test_blocks_left_behind_by_a_preemption_stop_the_engine_naming_the_sequence(monkeypatch):
    """A preemption that forgot to free its blocks (simulated) would leave every request waiting
    for blocks nobody frees, the engine stepping forever; the scheduler raises instead."""
    s = make(num_blocks=6, block_size=4)
    s.max_stalled_steps = 8

    def preempt_keeping_blocks(seq):
        s.running.remove(seq)
        seq.num_cached = 0
        seq.status = Status.WAITING
        s.waiting.appendleft(seq)

    monkeypatch.setattr(s, "_preempt", preempt_keeping_blocks)
    a, b, c = seq(3, max_tokens=20), seq(3, max_tokens=20, start=2), seq(3, max_tokens=20, start=3)
    a.request_id, c.request_id = "req-a", "req-c"
    for q in (a, b, c):
        s.add(q)
    with pytest.raises(SchedulerStalled) as info:
        for _ in range(100):
            step(s)
    message = str(info.value)
    assert "no progress for 8 steps: request 'req-a'" in message and "needs 3 KV blocks and 0 of 6 are free" in message
    assert f"sequence {c.seq_id} (request 'req-c', waiting): 2 blocks" in message


def test_steps_that_only_wait_briefly_are_not_a_stall():
    s = make(num_blocks=6, block_size=4)
    s.max_stalled_steps = 2  # a preemption-only step is followed by a step that runs
    outputs = run(s, [seq(3, max_tokens=20), seq(3, max_tokens=20, start=2), seq(3, max_tokens=20, start=3)])
    assert [len(o) for o in outputs] == [20, 20, 20] and s.num_preemptions > 0
