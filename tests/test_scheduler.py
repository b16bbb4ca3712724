"""The scheduler on CPU with no model: planning, budgets, preemption, stops, abort, rollback.

A fake "model" stands in for the step: it samples a token derived from the sequence's tokens, so
outputs depend only on each sequence's own history, the way a real model's do.
"""

import os

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from layerzoo.capabilities import LayerCapabilities, ModelCapabilities
from layerzoo.errors import LayerStateNotRewindable
from layerzoo.runtime.block_manager import BlockManager
from layerzoo.runtime.scheduler import Scheduler, SchedulerConfig
from layerzoo.sampling import SamplingParams
from layerzoo.sequence import FinishReason, Sequence, Status

EOS = 0


def fake_token(seq: Sequence) -> int:
    """A deterministic function of the sequence's own tokens (never EOS unless asked)."""
    return 1 + (sum(seq.token_ids) * 31 + len(seq)) % 50


def make(num_blocks=32, block_size=4, caps=None, **config):
    blocks = BlockManager(num_blocks, block_size)
    return Scheduler(SchedulerConfig(**config), blocks, caps, eos_token_ids=[EOS])


def step(scheduler: Scheduler):
    plan = scheduler.schedule()
    sampled = {c.seq.seq_id: fake_token(c.seq) for c in plan.chunks if c.samples}
    return plan, scheduler.update(plan, sampled)


def run(scheduler, seqs):
    for s in seqs:
        scheduler.add(s)
    while scheduler.has_unfinished():
        step(scheduler)
        scheduler.blocks.check_invariants()
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
    assert not s.blocks.has_sequence(a.seq_id)
    run(s, [])
    assert s.blocks.num_free_blocks() == s.blocks.num_blocks


def test_rollback_to_boundary_rewinds_and_continues():
    s = make()
    a = seq(6, max_tokens=10)
    s.add(a)
    for _ in range(5):
        step(s)
    before = list(a.output_token_ids)
    s.rollback_to_boundary(a, len(a.prompt_token_ids) + 2)
    assert a.output_token_ids == before[:2] and a.num_cached <= len(a) - 1
    s.blocks.check_invariants()
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
        self.s.blocks.check_invariants()
        for q in self.s.running:
            assert q.num_cached <= len(q)
            table = self.s.blocks.block_table(q.seq_id)
            assert len(table) * self.s.blocks.block_size >= q.num_cached

    def teardown(self):
        for _ in range(500):
            if not self.s.has_unfinished():
                break
            step(self.s)
        assert not self.s.has_unfinished()
        assert self.s.blocks.num_free_blocks() == self.s.blocks.num_blocks
        self.s.blocks.check_invariants()


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
    s.blocks.check_invariants()
