"""Adaptive draft length: per sequence, drafting follows acceptance, stops at none, resumes when a
shadow check (the proposer's guesses, unverified) says drafts would be accepted; greedy outputs
stay those of plain decoding."""

import pytest

from layerzoo.hookspecs import hookimpl
from layerzoo.speculative.adaptive import DRAFT_COST, SHADOW_MAX_GAP, VERIFY_COST, AdaptiveDraftLength, best_draft_length
from layerzoo.speculative.proposers import NgramProposer
from layerzoo.speculative.step_cost import RELAX_AFTER, StepCosts, step_clock
from layerzoo.testing import registered_plugin


def spin(seconds):
    """Work for ``seconds`` on the engine's CPU step clock: a cost the engine's step timing sees."""
    clock = step_clock("cpu")
    until = clock() + seconds
    while clock() < until:
        pass


def head_never_right(llm, monkeypatch):
    """Make ``llm``'s MTP head never right: its drafts are stored as -1, a token no model emits."""
    proposer = llm.engine.runner.mtp.proposer
    real_store = proposer.store
    monkeypatch.setattr(proposer, "store", lambda seq_id, n, drafts: real_store(seq_id, n, [-1] * len(drafts)))


@pytest.fixture
def tiny_qwen3_with_head(tiny_qwen3_dir, tmp_path):
    """A copy of the tiny Qwen3 checkpoint with a random Qwen-layout MTP head."""
    import shutil

    from layerzoo.testing.checkpoints import add_mtp_head

    path = tmp_path / "with-head"
    shutil.copytree(tiny_qwen3_dir, path)
    add_mtp_head(path, "qwen", source_layer=0)
    return path


def test_the_draft_length_is_the_one_with_the_largest_expected_gain():
    assert best_draft_length(0.95, 4) == 4 and best_draft_length(0.8, 4) == 4
    assert best_draft_length(0.5, 4) == 3  # the 4th draft's 0.5**4 = 0.06 is below its row's cost 0.1
    assert best_draft_length(0.4, 4) == 2
    assert best_draft_length(0.3, 4) == 0  # 0.3 does not pay the verify's own cost and its row
    assert best_draft_length(1.0, 2) == 2 and best_draft_length(0.99, 0) == 0


def test_a_fresh_sequence_drafts_once_a_shadow_guess_of_its_own_came_true():
    ngram = NgramProposer(prompt_lookup_max=2)
    policy = AdaptiveDraftLength(ngram.propose)
    ids = [1, 2, 3, 4, 5, 6, 1, 2]
    assert policy.draft_length(3, ids, 4) == 0 and policy.seqs[3].shadow == [3, 4, 5, 6]
    seq = ids + [3, 4, 5, 6]  # plain decoding generates the guess, one token per step
    lengths = [policy.draft_length(3, seq[:i], 4) for i in range(9, len(seq) + 1)]
    assert lengths[-1] > 0 and policy.shadow_checks >= 1, lengths


def test_no_acceptance_drops_to_zero_and_a_matching_shadow_brings_it_back():
    ngram = NgramProposer(prompt_lookup_max=2)
    calls = []
    policy = AdaptiveDraftLength(lambda ids, k: calls.append(len(ids)) or ngram.propose(ids, k))
    ids = [1, 2, 3, 4, 5, 6]
    for _ in range(3):
        policy.observe(7, 4, 4)  # everything accepted: drafting
    assert policy.draft_length(7, ids, 4) == 4
    lengths = []
    for _ in range(8):
        policy.observe(7, 4, 0)  # nothing accepted
        lengths.append(policy.draft_length(7, ids, 4))
    assert lengths[-1] == 0 and lengths == sorted(lengths, reverse=True), lengths
    # Not drafting: the proposer still guesses (a shadow draft); no proposal here (no repeat yet).
    assert calls
    # The text starts repeating: the n-gram guess [3, 4, 5, 6] after "... 1 2" is right each time.
    seq = ids + [1, 2]
    assert policy.draft_length(7, seq, 4) == 0 and policy.seqs[7].shadow == [3, 4, 5, 6]
    seq += [3, 4, 5, 6]  # generated one token per step by plain decoding
    recovered = [policy.draft_length(7, seq[:i], 4) for i in range(9, len(seq) + 1)]
    assert recovered[0] == 0 or recovered[1] > 0, recovered  # scored token by token: back within two steps
    assert recovered[-1] > 0, recovered
    assert policy.shadow_checks >= 1 and not policy.seqs[7].shadow  # drafting again: no shadow pending
    policy.forget(7)
    assert 7 not in policy.seqs


def test_shadow_guesses_that_keep_missing_back_off_and_a_hit_resets_the_wait():
    guesses = []
    right = {"from": None}

    def propose(ids, k):
        guesses.append(len(ids))
        if right["from"] is not None and len(ids) >= right["from"]:
            return [len(ids) + i for i in range(k)]  # the token ids below count up: right
        return [-1] * k

    policy = AdaptiveDraftLength(propose)
    seq = list(range(40))  # token i at position i
    for n in range(1, len(seq) + 1):
        assert policy.draft_length(5, seq[:n], 4) == 0
    gaps = [b - a for a, b in zip(guesses, guesses[1:])]
    assert gaps[:3] == [min(1 << i, SHADOW_MAX_GAP) for i in range(3)] and set(gaps[3:]) == {SHADOW_MAX_GAP}, guesses
    assert len(guesses) <= len(seq) // SHADOW_MAX_GAP + 2  # not a guess on every step
    right["from"] = 40
    seq += list(range(40, 50))
    drafted = [policy.draft_length(5, seq[:n], 4) for n in range(41, 51)]
    assert any(drafted), (guesses, drafted)  # the next guess came true: drafting resumed


def test_one_right_token_of_a_shadow_guess_does_not_start_drafting():
    policy = AdaptiveDraftLength(lambda ids, k: [7, 8, 9, 10][:k])
    assert policy.draft_length(1, [1, 2, 3], 4) == 0 and policy.seqs[1].shadow == [7, 8, 9, 10]
    assert policy.draft_length(1, [1, 2, 3, 7], 4) == 0  # one right token: luck as often as a copy
    assert policy.draft_length(1, [1, 2, 3, 7, 8], 4) == 4  # SHADOW_MATCH right: drafting
    # Right for one token, then wrong: scored as a miss, nothing accepted.
    assert policy.draft_length(2, [1, 2, 3], 4) == 0 and policy.draft_length(2, [1, 2, 3, 7], 4) == 0
    assert policy.draft_length(2, [1, 2, 3, 7, 5], 4) == 0
    assert policy.seqs[2].accepted == 0 and policy.seqs[2].rejected > 1 and policy.shadow_checks == 2


def test_a_wrong_shadow_guess_is_scored_at_its_first_miss():
    policy = AdaptiveDraftLength(lambda ids, k: [99] * k)
    for _ in range(6):
        policy.observe(1, 4, 0)
    assert policy.draft_length(1, [5, 6], 4) == 0
    before = policy.seqs[1].rejected
    policy.draft_length(1, [5, 6, 7], 4)  # 7 != 99: scored now, not after 4 tokens
    assert policy.seqs[1].rejected > before * 0.6 and policy.shadow_checks == 1


def test_fixed_mode_always_drafts_k_max():
    policy = AdaptiveDraftLength(lambda ids, k: [], adaptive=False)
    for _ in range(5):
        policy.observe(1, 4, 0)
    assert policy.draft_length(1, [1, 2], 4) == 4


# -- the measured cost model --------------------------------------------------------------------------


def feed(costs, batch, overhead, per_draft, plain=0.002, drafts=(0, 2, 4, 8, 0, 6), rounds=40, verifiers=2):
    """Steps of a machine where a verify step's excess is ``overhead + per_draft * D`` sequence-steps."""
    for _ in range(rounds):
        for d in drafts:
            seconds = plain * (1 + (overhead + per_draft * d) / batch) if d else plain
            costs.observe(batch, d, verifiers if d else 0, seconds)


def test_step_costs_start_at_the_prior_and_follow_the_measurements():
    costs = StepCosts()
    assert costs.costs() == pytest.approx((0.0, DRAFT_COST))  # with the policy's margin: the old constants
    feed(costs, batch=6, overhead=1.2, per_draft=0.3)
    overhead, per_draft = costs.fit()
    assert overhead == pytest.approx(1.2, rel=0.05) and per_draft == pytest.approx(0.3, rel=0.05)
    # The fixed part is shared by the step's verifiers (two here).
    assert costs.costs() == pytest.approx((0.6, 0.3), rel=0.1)
    feed(costs, batch=6, overhead=0.0, per_draft=0.02)  # the machine changed: cheap rows now
    assert costs.costs() == pytest.approx((0.0, 0.02), abs=0.02)
    # A verify step measured faster than the plain one (noise) never makes drafting a gain.
    costs.observe(6, 4, 1, 0.001)
    assert min(costs.fit()) >= 0
    faster = StepCosts()  # verifies measured faster than plain, less so the more rows (noise, a busy host)
    feed(faster, batch=1, overhead=-0.5, per_draft=0.01)
    assert min(faster.fit()) >= 0 and min(faster.costs()) >= 0, faster.fit()
    same = StepCosts()  # nor where every verify drafted as many rows (a fixed k): the fit is all per row
    for _ in range(40):
        same.observe(6, 0, 0, 0.002)
        same.observe(6, 6, 6, 0.0015)
    assert min(same.fit()) >= 0, same.fit()


def test_a_fit_that_stopped_drafting_relaxes_to_the_prior_while_nothing_verifies():
    costs = StepCosts()
    feed(costs, batch=6, overhead=20.0, per_draft=2.0)  # verifies far too dear: nobody drafts
    assert best_draft_length(1.0, 4, *costs.costs()) == 0
    for _ in range(RELAX_AFTER):
        costs.observe(6, 0, 0, 0.002)
    assert best_draft_length(1.0, 4, *costs.costs()) == 0  # a short pause changes nothing
    for _ in range(300):
        costs.observe(6, 0, 0, 0.002)
    verify, draft = costs.costs()  # near the prior again: drafts with good acceptance, to measure anew
    # (the prior's row: a tenth of the smallest batch's plain step, which is six sequence-steps here)
    assert verify + 4 * draft < 4 * DRAFT_COST * 6 + 0.3 and best_draft_length(0.9, 4, VERIFY_COST + verify, draft) == 4


def test_a_resting_steps_quick_observe_measures_what_the_general_one_does():
    """Most steps of a sequence that rests are plain steps of the batch measured last: `observe`
    takes them in fewer operations, counting the relaxing steps and applying them when the fit or
    the head's price is read. What it measures is the general path's: a second record whose every
    step is forced through that path (no cached costs) ends with the same means, fit, head price
    and guesses' balance."""
    quick, general = StepCosts(), StepCosts()
    steps = [(2, 0, 0, 0.001), (2, 4, 2, 0.0016, 0.0003, 2), (2, 0, 0, 0.0011, 0.0002, 1)]
    steps += [(2, 0, 0, 0.001 + 0.0001 * (i % 3)) for i in range(3 * RELAX_AFTER)]
    steps += [(2, 2, 1, 0.0014, 0.0002, 1)] + [(2, 0, 0, 0.0012)] * (2 * RELAX_AFTER)
    for step in steps:
        quick.observe(*step)
        general._costs_at = None  # (the quick path needs cached costs)
        general.observe(*step)
    assert quick.plain == pytest.approx(general.plain) and quick.explore == pytest.approx(general.explore)
    assert quick.fit() == pytest.approx(general.fit()) and quick.head == pytest.approx(general.head)
    assert quick.fit() != pytest.approx(StepCosts(plain=dict(quick.plain), batch=2).fit())  # (not the prior alone)

def test_the_prior_prices_a_draft_row_as_a_share_of_a_one_sequence_step():
    """The prior is a share of a plain step of one sequence (a row costs about the same time at any
    batch): the smallest batch measured stands in for it. Priced at the batch's sequence-step
    instead, six sequences' rows cost a sixth of that, and the MTP head's guesses looked worth a
    head step where drafting did not pay (0.90-0.92x plain, six requests of the embedded model)."""
    costs = StepCosts()
    costs.observe(6, 0, 0, 0.0012)  # only six sequences measured: their step stands in
    assert costs.fit() == pytest.approx((0.0, DRAFT_COST * 6))
    costs.observe(1, 0, 0, 0.0006)  # one sequence: the prior as it was measured
    assert costs.fit() == pytest.approx((0.0, DRAFT_COST))
    costs.observe(6, 0, 0, 0.0012)  # six again: a row is a tenth of the one-sequence step
    assert costs.fit() == pytest.approx((0.0, DRAFT_COST * 0.0006 / 0.0002))
    # The MTP head's work at most of a sequence-step: at the prior, six sequences whose every draft
    # came true would not draft k <= 3 (it prices no guess there), one would.
    six, one = StepCosts(), StepCosts()
    for _ in range(30):
        six.observe(6, 0, 0, 0.0012 + 0.00096, head_seconds=0.00096, head_drafted=6)
        one.observe(1, 0, 0, 0.0006 + 0.00016, head_seconds=0.00016, head_drafted=1)
    assert not AdaptiveDraftLength(lambda ids, k: [], costs=six)._may_pay(3)
    assert AdaptiveDraftLength(lambda ids, k: [], costs=one)._may_pay(3)


def test_step_costs_price_the_mtp_heads_work_per_drafting_sequence():
    costs = StepCosts()
    for _ in range(30):
        costs.observe(4, 0, 0, 0.004 + 0.002, head_seconds=0.002, head_drafted=2)  # 1 ms of head work per sequence
    assert costs.plain[4] == pytest.approx(0.004)  # the head's work (guesses) is not the plain step's
    verify, _ = costs.costs()
    assert verify == pytest.approx(0.001 * 4 / 0.004)  # a sequence-step is 1 ms here


def test_a_head_cost_measured_too_dear_is_measured_again_after_a_pause():
    """One slow head step (another process took the core) priced the MTP head past anything a draft
    can emit: no guess was made, so the head never ran to measure it again, and a request that would
    draft at 1.4x plain drafted nothing for the rest of its life. While the head does not run its
    price relaxes like the verify fit, and guesses come back to measure it."""
    costs = StepCosts()
    policy = AdaptiveDraftLength(lambda ids, k: [], costs=costs)
    for _ in range(10):
        costs.observe(1, 0, 0, 0.0007)
        costs.observe(1, 3, 1, 0.0009, head_seconds=0.0002, head_drafted=1)
    assert policy._may_pay(3)
    costs.observe(1, 3, 1, 0.0500, head_seconds=0.0480, head_drafted=1)  # one head step 200x slower than the rest
    for _ in range(RELAX_AFTER):
        costs.observe(1, 0, 0, 0.0007)
    assert not policy._may_pay(3)  # a short pause changes nothing
    for _ in range(300):
        costs.observe(1, 0, 0, 0.0007)
    assert policy._may_pay(3)
    costs.observe(1, 3, 1, 0.0009, head_seconds=0.0002, head_drafted=1)  # measured again: the usual price
    assert costs.head == pytest.approx(0.0002, rel=0.5)


def test_a_batch_that_always_verifies_takes_a_plain_step_to_price_its_verifies():
    """A verify's cost is measured against a plain step of the same batch. Six sequences that all
    drafted from their first step never made one: the fit kept its prior for the whole run and
    drafted where each verify cost more than it emitted (the rewrite workload's six requests, MTP
    k <= 1: a verify every step, 0.80x plain). The policy now lets no sequence draft for one step
    when the batch has no plain measure, and again after `PLAIN_PROBE` verify steps in a row."""
    from layerzoo.speculative.step_cost import PLAIN_PROBE

    costs = StepCosts()
    policy = AdaptiveDraftLength(lambda ids, k: ids[-k:], costs=costs)
    for seq_id in range(6):
        policy.seqs[seq_id].accepted, policy.seqs[seq_id].rejected = 8.0, 0.0
    costs.observe(6, 24, 6, 0.004)  # a verify step of a batch never measured plain
    assert [policy.draft_length(i, list(range(30)), 4) for i in range(6)] == [0] * 6
    costs.observe(6, 0, 0, 0.001)
    assert all(policy.draft_length(i, list(range(31)), 4) > 0 for i in range(6))
    for _ in range(PLAIN_PROBE - 1):
        costs.observe(6, 24, 6, 0.0015)
        assert policy.draft_length(0, list(range(31)), 4) > 0
    costs.observe(6, 24, 6, 0.0015)
    assert policy.draft_length(0, list(range(31)), 4) == 0  # the plain mean is stale: measure it again
    fixed = AdaptiveDraftLength(lambda ids, k: ids[-k:], adaptive=False, costs=costs)
    assert fixed.draft_length(0, list(range(31)), 4) == 4  # fixed-k speculation is left alone


def test_steps_are_timed_on_the_engines_thread_alone():
    """The process's CPU clock adds other threads' time only at scheduler ticks (4 ms at HZ 250): with
    two OpenMP threads a 1 ms step read 1 or 5 ms, and the fit priced a 2-core EPYC's draft rows at
    a quarter of what they cost. The step clock reads the engine's own thread, exact to the
    microsecond, and never more than the wall time its step took."""
    import os
    import time

    import torch

    from layerzoo.speculative.step_cost import step_clock

    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs two cores for a second thread")
    clock, threads = step_clock("cpu"), torch.get_num_threads()
    a = torch.randn(256, 1024)
    b = torch.randn(1024, 1024)
    torch.set_num_threads(2)
    try:
        over = []
        for _ in range(40):
            wall, started = time.perf_counter(), clock()
            for _ in range(4):
                a @ b
            over.append((clock() - started) - (time.perf_counter() - wall))
    finally:
        torch.set_num_threads(threads)
    assert max(over) < 0.0005, max(over)


def test_a_draft_row_is_priced_in_seconds_at_the_batch_of_the_moment():
    """A draft row costs the same seconds at any batch, so its share of a sequence-step (what a
    token is worth) shrinks with the batch: the last request of a batch drafts where six did not."""
    costs = StepCosts()
    for _ in range(40):  # six sequences: plain steps 1.2 ms, each verified draft row 0.2 ms more
        costs.observe(6, 0, 0, 0.0012)
        costs.observe(6, 12, 6, 0.0012 + 0.0002 * 12)
    _, per_draft = costs.costs()
    assert per_draft == pytest.approx(0.0002 / (0.0012 / 6), rel=0.05)  # a whole sequence-step
    for _ in range(10):  # one sequence left: a plain step 0.8 ms
        costs.observe(1, 0, 0, 0.0008)
    _, per_draft = costs.costs()
    assert per_draft == pytest.approx(0.0002 / 0.0008, rel=0.05)
    policy = AdaptiveDraftLength(lambda ids, k: [], costs=costs)
    for _ in range(4):
        policy.observe(1, 3, 2)  # 2 of 3 drafts accepted
    assert policy.draft_length(1, [1, 2, 3], 3) > 0
    costs.observe(6, 0, 0, 0.0012)  # six again
    assert policy.draft_length(1, [1, 2, 3], 3) == 0
    # A batch never measured plain is priced at the nearest one's plain step.
    costs.observe(2, 4, 2, 0.0012 + 0.0008)
    assert costs.unit() == pytest.approx(0.0008 / 2, rel=0.01)


def test_the_policy_stops_drafting_where_a_verify_costs_more_than_it_emits():
    slow, cheap = StepCosts(), StepCosts()
    feed(slow, batch=6, overhead=3.0, per_draft=1.2, verifiers=1)  # a verify step ~2x a plain one
    feed(cheap, batch=6, overhead=0.05, per_draft=0.02, verifiers=1)
    lengths = {}
    for name, costs in (("slow", slow), ("cheap", cheap)):
        policy = AdaptiveDraftLength(lambda ids, k: [], costs=costs)
        for _ in range(4):
            policy.observe(1, 4, 4)  # every draft accepted
        lengths[name] = policy.draft_length(1, [1, 2, 3], 4)
    assert lengths == {"slow": 0, "cheap": 4}
    # At the prior, the same acceptance drafts (as before there was a cost model).
    policy = AdaptiveDraftLength(lambda ids, k: [])
    for _ in range(4):
        policy.observe(1, 4, 4)
    assert policy.draft_length(1, [1, 2, 3], 4) == 4


def test_one_rejected_verify_stops_a_copy_but_not_a_head_that_has_been_right():
    """A proposer whose drafts come a step after the ask (the MTP head) forgets its sequence's
    outcomes more slowly (`DEFERRED_DECAY`) than the n-gram proposer (`DECAY`): a copy that stopped
    matching is over, while the head's skill at the text moves slowly. Where a verify costs most of
    a sequence-step (the embedded model at one request), one rejected verify after a run of accepted
    ones stops the n-gram sequence and keeps the head's drafting."""
    from layerzoo.speculative.adaptive import DECAY, DEFERRED_DECAY

    assert DEFERRED_DECAY > DECAY
    costs = StepCosts()
    feed(costs, batch=1, overhead=1.15, per_draft=0.1, verifiers=1)
    ngram = AdaptiveDraftLength(lambda ids, k: [], costs=costs)
    mtp = AdaptiveDraftLength(lambda ids, k: [], propose_for=lambda seq_id, ids, k: [], peek=lambda seq_id, ids, k: [],
                              costs=costs)
    lengths = {}
    for name, policy in (("ngram", ngram), ("mtp", mtp)):
        for _ in range(6):
            policy.observe(1, 3, 3)
        assert policy.draft_length(1, list(range(40)), 3) == 3, name
        policy.observe(1, 3, 0)  # the next verify's first draft is rejected
        lengths[name] = policy.draft_length(1, list(range(41)), 3)
    assert lengths == {"ngram": 0, "mtp": 3}


def test_a_head_that_drafts_goes_on_at_a_smaller_margin_until_two_verifies_in_a_row_take_nothing():
    """Having stopped, a sequence of a deferred proposer drafts again only after a guess (a head step)
    came true: while it drafts it goes on at `KEEP_MARGIN`, below the margin a fresh estimate must
    clear, until `KEEP_MISSES` verifies in a row took no draft. The n-gram proposer keeps one margin."""
    from layerzoo.speculative.adaptive import KEEP_MARGIN, KEEP_MISSES

    assert KEEP_MARGIN < VERIFY_COST and KEEP_MISSES == 2
    ngram = AdaptiveDraftLength(lambda ids, k: [])
    mtp = AdaptiveDraftLength(lambda ids, k: [], propose_for=lambda seq_id, ids, k: [], peek=lambda seq_id, ids, k: [])
    ids = list(range(1, 30))

    def estimate_at(policy):
        state = policy.seqs[1]  # p = (0.5 + 0.5) / (0.5 + 2.5 + 1) = 0.25
        state.accepted, state.rejected, state.best = 0.5, 2.5, None
        assert state.acceptance() == 0.25
        # (at 0.25 one draft gains 0.25 - DRAFT_COST: past KEEP_MARGIN, short of VERIFY_COST)
        assert best_draft_length(0.25, 3, KEEP_MARGIN) > 0 == best_draft_length(0.25, 3, VERIFY_COST)

    for policy in (ngram, mtp):
        policy.seqs[1].accepted, policy.seqs[1].rejected = 8.0, 0.0
        assert policy.draft_length(1, ids, 3) == 3
        policy.observe(1, 3, 1)  # it took one draft of three
        estimate_at(policy)
    assert ngram.draft_length(1, ids, 3) == 0
    assert mtp.draft_length(1, ids, 3) > 0  # drafting: it goes on
    mtp.observe(1, 1, 0)
    estimate_at(mtp)
    assert mtp.draft_length(1, ids, 3) > 0  # one verify that took nothing
    mtp.observe(1, 1, 0)
    estimate_at(mtp)
    assert mtp.draft_length(1, ids, 3) == 0  # two in a row: the fresh margin, and it stops
    estimate_at(mtp)
    assert mtp.draft_length(1, ids, 3) == 0  # stopped: a guess must come true first


# -- in the engine ----------------------------------------------------------------------------------


class ScriptedProposer:
    """Guesses wrong (a token the model never picks here) until ``switch`` output tokens exist, then
    drafts the known greedy continuation: no acceptance, then full acceptance."""

    def __init__(self, prompt_len: int, answer: list[int], switch: int, wrong: int):
        self.prompt_len, self.answer, self.switch, self.wrong = prompt_len, answer, switch, wrong

    def propose(self, token_ids, k):
        done = len(token_ids) - self.prompt_len
        if done < self.switch:
            return [self.wrong] * k
        return list(self.answer[done : done + k])

    def propose_batch(self, token_ids, k):
        return [self.propose(ids, k) for ids in token_ids]


class ScriptedPlugin:
    def __init__(self, proposer):
        self.proposer = proposer

    @hookimpl
    def register_proposers(self, register):
        register("scripted", lambda config: self.proposer)


@pytest.mark.parametrize("adaptive", [True, False])
def test_engine_stops_drafting_without_acceptance_and_resumes(tiny_qwen3_dir, adaptive, monkeypatch):
    from layerzoo import LLM, SamplingParams

    # Acceptance alone decides here: the verify cost stays at its prior (measured step times on a
    # busy machine made the resumption step vary, and the test flaky).
    monkeypatch.setattr(StepCosts, "observe", lambda self, *args, **kwargs: None)

    prompt = [5, 9, 14, 3, 22, 7]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    plain = LLM(str(tiny_qwen3_dir), dtype="float32").generate([{"prompt_token_ids": prompt}], params)[0]
    answer = plain.outputs[0].token_ids
    wrong = next(t for t in range(64) if t not in answer)
    proposer = ScriptedProposer(len(prompt), answer, switch=20, wrong=wrong)
    with registered_plugin(ScriptedPlugin(proposer), "scripted-proposer"):
        llm = LLM(str(tiny_qwen3_dir), dtype="float32",
                  speculative_config={"method": "scripted", "num_speculative_tokens": 4, "adaptive": adaptive})
        drafted_at = []
        engine = llm.engine
        real = engine.scheduler.proposer

        class Spy:  # the scheduler's proposals (the policy's shadow guesses go to the real one)
            def propose(self, token_ids, k):
                draft = real.propose(token_ids, k)
                if draft:
                    drafted_at.append(len(token_ids) - len(prompt))
                return draft

        engine.scheduler.proposer = Spy()
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0]
    assert out.outputs[0].token_ids == answer  # verification is exact: greedy output unchanged
    wrong_phase = [n for n in drafted_at if n < 20]
    right_phase = [n for n in drafted_at if n >= 20]
    if adaptive:
        assert len(wrong_phase) <= 5, drafted_at  # a few rejected verifies, then no drafting at all
        assert right_phase and engine.stats.spec_accepted_tokens >= 8, (drafted_at, engine.stats)
        assert not engine.scheduler.draft_policy.seqs  # the finished sequence's state is dropped
    else:
        assert len(wrong_phase) == 19  # fixed k drafts (and is rejected) at every decode step (outputs 1..19)


@pytest.mark.parametrize("slow_verify", [False, True])
def test_engine_measures_what_a_verify_costs_and_stops_drafting_when_it_never_pays(tiny_qwen3_dir, slow_verify):
    """A proposer that always drafts the right continuation: where a step's cost hardly grows with
    its rows (10 ms of injected work in every step) the engine keeps drafting; with every verify
    step slowed (an injected cost far above the 4 tokens a verify can emit) it measures that and
    stops (the few verifies: the prior's first ones, and one more after the fit relaxed toward the
    prior, measured anew)."""
    import time

    from layerzoo import LLM, SamplingParams

    prompts = [[5, 9, 14, 3, 22, 7], [8, 1, 30, 2]]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = LLM(str(tiny_qwen3_dir), dtype="float32").generate([{"prompt_token_ids": p} for p in prompts], params)
    answers = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain)}

    class Oracle:  # drafts what greedy decoding will generate
        def propose(self, token_ids, k):
            for prompt, answer in answers.items():
                if tuple(token_ids[: len(prompt)]) == prompt:
                    done = len(token_ids) - len(prompt)
                    return list(answer[done : done + k])
            return []

    with registered_plugin(ScriptedPlugin(Oracle()), "scripted-proposer"):
        llm = LLM(str(tiny_qwen3_dir), dtype="float32", speculative_config={"method": "scripted", "num_speculative_tokens": 4})
    engine = llm.engine
    execute = engine.executor.execute

    policy, hopeless = engine.scheduler.draft_policy, []

    def injected_execute(plan):
        started = time.thread_time()
        result = execute(plan)
        if not slow_verify:  # every step 10 ms of work that rows do not add to (a big model's weights)
            spin(0.01)
        elif any(c.is_verify for c in plan.decodes):  # a verify step takes 20 plain steps
            spin(19 * (time.thread_time() - started) + 0.02)
        hopeless.append(not policy._may_pay(4))  # (the costs as the last step left them)
        return result

    engine.executor.execute = injected_execute
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    costs = engine.scheduler.draft_policy.costs
    fixed, per_draft = costs.costs()
    drafts_at_full_acceptance = best_draft_length(1.0, 4, VERIFY_COST + fixed, per_draft)
    if slow_verify:  # (the fit may have relaxed toward the prior by the end, with no verify since)
        assert any(hopeless) and engine.stats.spec_verify_steps <= 6, (costs.costs(), engine.stats.spec_verify_steps)
    else:
        assert drafts_at_full_acceptance == 4 and engine.stats.spec_verify_steps >= 12, (costs.costs(), engine.stats.spec_verify_steps)


def test_the_mtp_heads_work_is_timed_into_the_cost_model(tiny_qwen3_dir, tiny_qwen3_with_head):
    from layerzoo import LLM, SamplingParams

    path = tiny_qwen3_with_head
    prompts = [{"prompt_token_ids": [5, 9, 14, 3, 22, 7]}, {"prompt_token_ids": [8, 1, 30, 2]}]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = LLM(str(tiny_qwen3_dir), dtype="float32").generate(prompts, params)
    llm = LLM(str(path), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 3, "adaptive": False})
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    costs = llm.engine.scheduler.draft_policy.costs
    assert costs.head is not None and costs.head > 0  # seconds of the head's work per drafting sequence
    verify, _ = costs.costs()
    overhead, _ = costs.fit()
    assert verify > overhead / max(costs.verifiers, 1.0)  # drafting is priced with them


def test_a_head_call_at_a_shape_it_has_not_run_before_is_not_what_drafting_costs(tiny_qwen3_dir, tiny_qwen3_with_head):
    """The head's op-by-op path pays once per shape (the AVX2 build of the embedded model: 2.0-2.9
    ms for a head step at a new row count against ~0.4 ms after): a step whose head ran a shape
    for the first time is timed without the head's work, which would price every later guess and
    draft at the one-time cost (it kept the policy from drafting for requests on end)."""
    from layerzoo import LLM, SamplingParams

    prompts = [{"prompt_token_ids": [5, 9, 14, 3, 22, 7]}, {"prompt_token_ids": [8, 1, 30, 2]}]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)  # (a few steps: the decayed mean forgets)
    plain = LLM(str(tiny_qwen3_dir), dtype="float32").generate(prompts, params)
    llm = LLM(str(tiny_qwen3_with_head), dtype="float32",
              speculative_config={"method": "mtp", "num_speculative_tokens": 1, "adaptive": False})
    model, seen = llm.engine.runner.mtp.model, set()
    real = model.mtp_draft

    def first_time_slow(ids, previous, ctx, rows):
        if (ids.shape[0], rows.shape[0]) not in seen:
            seen.add((ids.shape[0], rows.shape[0]))
            spin(0.05)  # the one-time cost of a new shape
        return real(ids, previous, ctx, rows)

    model.mtp_draft = first_time_slow
    outs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in plain]
    costs = llm.engine.scheduler.draft_policy.costs
    assert len(seen) >= 2 and llm.engine.stats.spec_verify_steps >= 2  # (the prompts' shape, then the verifies')
    assert costs.head is not None and 0 < costs.head < 0.002, costs.head  # the warm head step (~0.1 ms here; 5 ms with the cold one)
    assert max(costs.plain.values()) < 0.01, costs.plain  # nor in the plain steps' mean


def test_the_heads_step_is_priced_even_without_chained_rows(tiny_qwen3_with_head):
    """With one draft a sequence the head runs one step and chains nothing: that step is still what
    drafting costs beyond the verify's rows (it was left in the plain steps' mean and the fit, and
    a shadow guess's head step made the plain step look dearer, its drafts cheaper)."""
    from layerzoo import LLM, SamplingParams

    path = tiny_qwen3_with_head
    llm = LLM(str(path), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 1, "adaptive": False})
    llm.generate([{"prompt_token_ids": [5, 9, 14, 3, 22, 7]}, {"prompt_token_ids": [8, 1, 30, 2]}],
                 SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    costs = llm.engine.scheduler.draft_policy.costs
    assert costs.head is not None and costs.head > 0


def test_a_steps_time_counts_the_engines_scheduling_and_outputs(tiny_qwen3_dir):
    """What a verify costs is the whole step's: scheduling its drafts and taking its tokens are
    Python work that grows with them, so the engine times from the schedule to the step's outputs."""
    from layerzoo import LLM, SamplingParams

    llm = LLM(str(tiny_qwen3_dir), dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    scheduler = llm.engine.scheduler
    schedule = scheduler.schedule

    def slow_schedule():
        spin(0.02)
        return schedule()

    scheduler.schedule = slow_schedule
    llm.generate([{"prompt_token_ids": [5, 9, 14, 3]}], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    assert scheduler.draft_policy.costs.plain[1] >= 0.02


def test_a_shadow_guess_with_nothing_to_copy_waits_before_asking_again():
    """A proposer with no match returns nothing: the policy waits SHADOW_MAX_GAP tokens before
    scanning again instead of scanning every step (the scan was most of a step's speculation cost
    on the low-acceptance workload)."""
    calls = []
    policy = AdaptiveDraftLength(lambda ids, k: calls.append(len(ids)) or [])
    tokens = list(range(10))
    for _ in range(12):
        assert policy.draft_length(0, tokens, 4) == 0
        tokens.append(len(tokens))
    assert calls == list(range(10, 22, SHADOW_MAX_GAP))


def test_the_draft_lengths_are_recomputed_only_when_the_costs_move():
    """Steady plain steps leave the costs' version (and every sequence's cached length) alone; a
    verify step that moves the costs bumps it."""
    costs = StepCosts()
    for _ in range(30):
        costs.observe(6, 0, 0, 0.0012)
        costs.observe(6, 12, 6, 0.0012 + 0.0002 * 12)
    versions = []
    for i in range(10):
        costs.observe(6, 0, 0, 0.0012 * (1 + 0.001 * (i % 2)))  # a plain step, within a permille
        versions.append(costs.version)
    assert len(set(versions)) == 1
    before = costs.costs()
    costs.observe(6, 12, 6, 0.0012 + 0.0008 * 12)  # draft rows four times as dear
    assert costs.version > versions[-1] and costs.costs()[1] > before[1]


def test_the_costs_are_computed_once_per_measurement(monkeypatch):
    """Every drafting sequence of a step asks for the costs: the fit runs once per observation."""
    costs = StepCosts()
    fits = []
    real = StepCosts.fit
    monkeypatch.setattr(StepCosts, "fit", lambda self: fits.append(1) or real(self))
    for _ in range(3):
        costs.costs()
    costs.observe(6, 0, 0, 0.002)
    first = costs.costs()
    assert costs.costs() == first and len(fits) == 2


def test_plain_steps_check_the_costs_every_few_steps_and_still_follow_a_slower_machine(monkeypatch):
    """Between verifies the fit runs every `PLAIN_RECHECK` plain steps, not after each (it cost ~8 us
    a step); a machine that becomes slower still moves the costs within that many steps, and a new
    batch is priced at once."""
    from layerzoo.speculative.step_cost import PLAIN_RECHECK

    costs = StepCosts()
    for _ in range(30):
        costs.observe(6, 0, 0, 0.0012)
        costs.observe(6, 12, 6, 0.0012 + 0.0002 * 12)
    fits = []
    real = StepCosts.fit
    monkeypatch.setattr(StepCosts, "fit", lambda self: fits.append(1) or real(self))
    before, version = costs.costs(), costs.version
    for _ in range(4 * PLAIN_RECHECK):
        costs.observe(6, 0, 0, 0.0024)  # plain steps twice as slow: a draft row is a smaller share
    assert len(fits) == 4
    assert costs.version > version and costs.costs()[1] < before[1]
    costs.observe(1, 0, 0, 0.0008)  # one sequence left
    assert len(fits) == 5


def test_the_first_plain_step_of_a_batch_prices_the_heads_work_at_once():
    """Fixed-k MTP verifies every step, so the first plain step of a batch is what turns the head's
    seconds into sequence-steps: the costs are checked there, not `PLAIN_RECHECK` steps on."""
    costs = StepCosts()
    costs.observe(2, 4, 2, 0.002, head_seconds=0.0002, head_drafted=2)  # a verify step: no plain step of 2 yet
    assert costs.costs()[0] < 0.5
    costs.observe(2, 0, 0, 0.0004)  # a sequence-step is 0.2 ms: the head's 0.1 ms a sequence is half of one
    assert costs.costs()[0] >= 0.5


def test_a_resting_sequence_keeps_no_rows_for_the_mtp_head(tiny_qwen3_dir, tiny_qwen3_with_head, monkeypatch):
    """While the adaptive policy's next guess for a sequence is far off (guesses missed), it tells
    the MTP proposer (`rest`), and the runner keeps none of the sequence's rows for the head until
    they lead up to the next guess: most steps of a run whose guesses keep missing leave the head
    alone, no hidden states recorded and no `draft` call (`MtpDrafter.begin` says so before the
    forward; every step passed its rows to the head's bookkeeping once, then every step entered
    `draft` to find none). Outputs stay plain decoding's."""
    from layerzoo import LLM, SamplingParams
    from layerzoo.speculative.mtp_drafter import MtpDrafter

    path = tiny_qwen3_with_head
    prompt = [{"prompt_token_ids": [5, 9, 14, 3, 22, 7]}]
    params = SamplingParams(temperature=0, max_tokens=80, ignore_eos=True)
    plain = LLM(str(tiny_qwen3_dir), dtype="float32").generate(prompt, params)
    llm = LLM(str(path), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    steps, recorded, drafted, rows = [], [], [], []
    real_begin, real_record, real_draft, real_rows = MtpDrafter.begin, MtpDrafter.record, MtpDrafter.draft, MtpDrafter.head_rows
    monkeypatch.setattr(MtpDrafter, "begin", lambda self, plan: steps.append(1) or real_begin(self, plan))
    monkeypatch.setattr(MtpDrafter, "record", lambda self, *a: recorded.append(1) or real_record(self, *a))
    monkeypatch.setattr(MtpDrafter, "draft", lambda self, *a: drafted.append(1) or real_draft(self, *a))
    monkeypatch.setattr(MtpDrafter, "head_rows", lambda self, *a: rows.append(len(out := real_rows(self, *a))) or out)
    head_never_right(llm, monkeypatch)
    outs = llm.generate(prompt, params)
    assert outs[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert llm.engine.stats.spec_verify_steps == 0
    assert len(steps) >= 79 and len(recorded) <= len(steps) // 2 and len(drafted) <= len(steps) // 2, (len(recorded), len(drafted))
    assert len(rows) - rows.count(0) <= len(steps) // 2, rows


def test_blocks_past_a_row_are_reserved_only_for_sequences_the_head_drafts_for(tiny_qwen3_dir, tiny_qwen3_with_head, monkeypatch):
    """The chained head rows write ``k - 1`` positions past a step's last row; the scheduler reserves
    their blocks only for the sequences the head drafts for after the step (`drafts_now`): a
    sequence that does not draft holds the blocks its tokens need, no more (every decode row
    reserved them before, and counted free blocks for them)."""
    from layerzoo import LLM, SamplingParams

    prompt = [{"prompt_token_ids": [5, 9, 14, 3, 22, 7]}]
    params = SamplingParams(temperature=0, max_tokens=70, ignore_eos=True)
    plain = LLM(str(tiny_qwen3_dir), dtype="float32").generate(prompt, params)
    llm = LLM(str(tiny_qwen3_with_head), dtype="float32", block_size=4,
              speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    head_never_right(llm, monkeypatch)
    scheduler, proposer = llm.engine.scheduler, llm.engine.runner.mtp.proposer
    blocks, seen = scheduler.cache.blocks, []
    real = scheduler.schedule

    def schedule():
        plan = real()
        for chunk in plan.decodes:
            end, held = chunk.start + chunk.num_tokens, len(plan.block_tables[chunk.seq_id])
            # (blocks the step grew the table by beyond its tokens' and what it held before; blocks past its chained rows)
            grown = held - max(blocks.blocks_for(end), before.get(chunk.seq_id, 0))
            seen.append((proposer.drafts_now(chunk.seq_id), grown, held - blocks.blocks_for(end + 2)))
            before[chunk.seq_id] = held
        return plan

    before = {}
    monkeypatch.setattr(scheduler, "schedule", schedule)
    outs = llm.generate(prompt, params)
    assert outs[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    resting = [grown for asked, grown, _ in seen if not asked]
    assert len(resting) > 50 and not any(resting), seen
    guesses = [past for asked, _, past in seen if asked]  # (the fresh guesses at least)
    assert guesses and min(guesses) >= 0, seen  # a guess's chained rows have their blocks


def test_shadow_guesses_that_cost_model_work_take_at_most_their_share_of_the_time():
    """Each step earns `EXPLORE_SHARE` of its time for shadow guesses; the guesses the policy asked
    spend their share of the step's head seconds; no guess is asked while the balance is below zero,
    which starts (and is capped) at a plain step's worth. Six requests whose head was right about
    half the time (never enough to draft at that batch) ran a head step in 24 of 128 steps, 0.79x plain."""
    from layerzoo.speculative.step_cost import EXPLORE_SHARE

    costs = StepCosts()
    assert costs.may_guess()
    costs.observe(6, 0, 0, 0.001)  # a plain step of 1 ms: 1 ms to spend
    costs.guesses = 1  # the policy asked the head for one guess
    costs.observe(6, 0, 0, 0.001 + 0.0016, head_seconds=0.0016, head_drafted=1)
    assert not costs.may_guess() and costs.guesses == 0
    waits = [costs.guess_wait()]
    while not costs.may_guess():
        costs.observe(6, 0, 0, 0.001)
        waits.append(costs.guess_wait())
    assert len(waits) - 1 == pytest.approx(0.0006 / (EXPLORE_SHARE * 0.001), abs=2) and waits[0] == len(waits) - 1
    costs.observe(6, 12, 6, 0.003, head_seconds=0.0008, head_drafted=6)  # drafting's head work is not a guess's
    assert costs.may_guess()
    for _ in range(1000):  # nothing is saved up beyond a plain step's worth
        costs.observe(6, 0, 0, 0.001)
    costs.guesses = 1  # one guess beside three drafting sequences: a quarter of the head step
    costs.observe(6, 8, 3, 0.003 + 0.006, head_seconds=0.006, head_drafted=4)
    assert not costs.may_guess()


def test_a_cold_head_step_is_neither_the_heads_price_nor_a_plain_step_and_its_guesses_pay_the_usual_price():
    """`observe(..., head_cold=True)`: the head ran a shape for the first time (a one-time cost):
    the step counts without its head work, which prices nothing, and the guesses asked in it spend
    the head's usual price from their share (a sequence-step's before any was measured)."""
    from layerzoo.speculative.step_cost import EXPLORE_SHARE

    costs = StepCosts()
    costs.observe(1, 0, 0, 0.001)  # a plain step of 1 ms
    costs.guesses = 1
    costs.observe(1, 0, 0, 0.001 + 0.0005, head_seconds=0.0005, head_drafted=1)  # a warm guess: 0.5 ms
    assert costs.head == pytest.approx(0.0005)
    before, plain = costs.explore, costs.plain[1]
    costs.guesses = 1
    costs.observe(1, 0, 0, 0.001 + 0.003, head_seconds=0.003, head_drafted=1, head_cold=True)  # 3 ms, once
    assert costs.head == pytest.approx(0.0005) and costs.plain[1] == pytest.approx(plain)
    assert costs.explore == pytest.approx(before + EXPLORE_SHARE * 0.001 - 0.0005)
    fresh = StepCosts()
    fresh.observe(1, 0, 0, 0.001)
    fresh.guesses = 1
    fresh.observe(1, 0, 0, 0.004, head_seconds=0.003, head_drafted=1, head_cold=True)
    assert fresh.head is None and fresh.explore == pytest.approx(0.001 + EXPLORE_SHARE * 0.001 - 0.001)


def test_a_head_whose_guesses_spent_their_share_asks_for_none():
    """The policy asks a deferred proposer (the MTP head) for no shadow guess while the guesses'
    share of time is spent, past a fresh sequence's first `FRESH_GUESSES`; a sequence whose guess is
    due rests until the share is earned back (the runner keeps none of its rows meanwhile), then asks."""
    from layerzoo.speculative.adaptive import FRESH_GUESSES

    costs = StepCosts()
    asked, rests = [], {}
    policy = AdaptiveDraftLength(lambda ids, k: [], propose_for=lambda seq_id, ids, k: asked.append(seq_id) or [],
                                 peek=lambda seq_id, ids, k: [], rest=rests.__setitem__, costs=costs)
    costs.observe(1, 0, 0, 0.001)
    tokens = list(range(20))

    def decode(steps):
        """``steps`` plain decode steps of sequence 0; a step where the head ran costs 2 ms of it."""
        for _ in range(steps):
            before = len(asked)
            assert policy.draft_length(0, tokens, 3) == 0
            head = 0.002 if len(asked) > before else 0.0
            costs.observe(1, 0, 0, 0.001 + head, head_seconds=head, head_drafted=1 if head else 0)
            tokens.append(len(tokens))

    decode(20)
    assert len(asked) == FRESH_GUESSES and not costs.may_guess()  # fresh guesses ask whatever the balance
    wait = costs.guess_wait()
    assert wait > 100 and rests[0] > len(tokens) + wait // 2  # the runner need not keep its rows meanwhile
    decode(wait - 1)
    assert len(asked) == FRESH_GUESSES
    decode(20)
    assert len(asked) == FRESH_GUESSES + 1


def test_the_heads_price_relaxes_only_while_guesses_could_measure_it_again():
    """While the head does not run its price drifts toward none (one slow step must not stop guesses
    for good), but not while the guesses' share of time is spent: six sequences each asked for drafts
    whenever the price had drifted, and the head ran for drafts no verify used."""
    costs = StepCosts()
    for _ in range(10):
        costs.observe(6, 0, 0, 0.001)
        costs.observe(6, 12, 6, 0.003, head_seconds=0.0012, head_drafted=6)
    costs.guesses = 1
    costs.observe(6, 0, 0, 0.001 + 0.02, head_seconds=0.02, head_drafted=1)  # one slow guess: overspent
    dear = costs.head
    for _ in range(3 * RELAX_AFTER):
        costs.observe(6, 0, 0, 0.001)
    assert not costs.may_guess() and costs.head == pytest.approx(dear)
    while not costs.may_guess():
        costs.observe(6, 0, 0, 0.001)
    for _ in range(3 * RELAX_AFTER):
        costs.observe(6, 0, 0, 0.001)
    assert costs.head < dear / 2


def test_an_engine_whose_guesses_have_no_share_of_time_runs_the_head_no_more(tiny_qwen3_with_head, monkeypatch):
    """The share is what the running engine asks: with none, after the first guess it paid for, a
    request whose head is never right runs the head on no further step (it guessed again after each
    wait before). Outputs stay plain decoding's."""
    from layerzoo import LLM, SamplingParams
    from layerzoo.speculative import step_cost
    from layerzoo.speculative.adaptive import FRESH_GUESSES

    prompt = [{"prompt_token_ids": [5, 9, 14, 3, 22, 7]}]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)

    def head_steps(share):
        monkeypatch.setattr(step_cost, "EXPLORE_SHARE", share)
        llm = LLM(str(tiny_qwen3_with_head), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 3})
        head_never_right(llm, monkeypatch)
        drafter, steps = llm.engine.runner.mtp, []
        real_draft = drafter._draft
        monkeypatch.setattr(drafter, "_draft", lambda plan, groups: steps.append(len(groups)) or real_draft(plan, groups))
        out = llm.generate(prompt, params)[0].outputs[0].token_ids
        return len(steps), out

    shared, out = head_steps(step_cost.EXPLORE_SHARE * 1000)  # as much as the guesses' waits ask
    none, same = head_steps(0.0)
    assert same == out
    # The prompt's step, the drafts asked beside its first guess, and the fresh sequence's guesses.
    assert none <= 2 + FRESH_GUESSES < shared, (none, shared)


def test_a_quiet_sequence_is_answered_without_its_token_list():
    """`quiet` holds, per sequence, the length below which `draft_length` would answer 0 with
    nothing to do (no guess pending or due, the runner told when the next comes): the scheduler
    reads it once a step and builds no token list for a sequence under it; a sequence is not quiet
    once its guess is due, and the map empties when the costs move."""
    from layerzoo.speculative.adaptive import FRESH_GUESSES

    costs = StepCosts()
    costs.observe(1, 0, 0, 0.001)
    policy = AdaptiveDraftLength(lambda ids, k: [], propose_for=lambda seq_id, ids, k: [], peek=lambda seq_id, ids, k: [],
                                 rest=lambda seq_id, n: None, costs=costs)
    tokens = list(range(20))
    assert 0 not in policy.quiet(3)  # a sequence it has not seen
    for _ in range(3 + FRESH_GUESSES):  # its fresh guesses miss: it waits
        policy.quiet(3)
        policy.draft_length(0, tokens, 3)
        tokens.append(len(tokens))
    state = policy.seqs[0]
    assert state.shadow_next > len(tokens) and len(tokens) < policy.quiet(3)[0]
    assert policy.quiet(3)[0] == state.shadow_next  # its next guess is due there
    assert 0 not in policy.quiet(2)  # (asked at another k_max: not known)
    costs.version += 1
    assert 0 not in policy.quiet(3)  # the costs moved: its draft length is asked again


def test_while_no_draft_could_pay_a_quiet_sequence_stays_quiet_when_the_costs_move():
    """Where no draft could pay (a verify dearer than anything it could emit), a sequence's quiet
    length is the rest the runner was told, which no cost changes: it survives the costs moving
    while none could pay, and goes once drafting could pay again."""
    dear, cheap = StepCosts(), StepCosts()
    feed(dear, batch=6, overhead=30.0, per_draft=3.0, verifiers=1)
    feed(cheap, batch=6, overhead=0.05, per_draft=0.02, verifiers=1)
    policy = AdaptiveDraftLength(lambda ids, k: [], propose_for=lambda seq_id, ids, k: [], peek=lambda seq_id, ids, k: [],
                                 rest=lambda seq_id, n: None, costs=dear)
    tokens = list(range(20))
    policy.quiet(3)
    assert policy.draft_length(0, tokens, 3) == 0 and not policy._may_pay(3)
    quiet = policy.quiet(3)[0]
    assert quiet > len(tokens) + 1  # (the runner's rest, less half the longest gap)
    dear.version += 1  # the costs moved; still nothing could pay
    assert policy.quiet(3).get(0) == quiet
    cheap.version = dear.version + 1
    policy.costs = cheap  # now a draft could pay: the sequence is asked again
    assert 0 not in policy.quiet(3)


def test_while_no_draft_could_pay_a_sequence_rests_and_the_runner_is_told_every_half_gap():
    """Where even drafts that all came true could not pay (a compute-bound batch), a sequence asks
    for no guess; the runner is told it rests for the proposer's longest gap, again when half of it
    is left, and between those it is `quiet` (`draft_length` ran every step before)."""
    costs = StepCosts()
    for _ in range(40):  # verifies that cost 20 plain steps' worth: nothing pays
        costs.observe(6, 0, 0, 0.001)
        costs.observe(6, 12, 6, 0.021)
    rests = []
    gap = 64  # the MTP proposer's longest wait
    policy = AdaptiveDraftLength(lambda ids, k: [], propose_for=lambda seq_id, ids, k: [], peek=lambda seq_id, ids, k: [],
                                 rest=lambda seq_id, n: rests.append((seq_id, n)), shadow_max_gap=gap, costs=costs)
    assert not policy._may_pay(3)
    tokens, asked = list(range(20)), []
    for _ in range(2 * gap):
        if len(tokens) >= policy.quiet(3).get(0, 0):
            asked.append(len(tokens))
            assert policy.draft_length(0, tokens, 3) == 0
        tokens.append(len(tokens))
    told = [20 + i * (gap // 2 + 1) for i in range(4)]  # once fewer than half the gap is left
    assert asked == told and rests == [(0, at + gap) for at in told]
    ngram = AdaptiveDraftLength(lambda ids, k: [], costs=costs)  # a proposer without `rest`
    ngram.quiet(3)
    ngram.draft_length(1, tokens, 3)
    assert len(tokens) + 1000 < ngram.quiet(3)[1]


def test_the_scheduler_skips_the_policy_for_a_resting_sequence(tiny_qwen3_with_head, tiny_qwen3_dir, monkeypatch):
    """A running engine asks `draft_length` (and builds the token list) only on the steps where a
    resting sequence is not at rest: with a head never right, most of a long request's steps."""
    from layerzoo import LLM, SamplingParams

    prompt = [{"prompt_token_ids": [5, 9, 14, 3, 22, 7]}]
    params = SamplingParams(temperature=0, max_tokens=120, ignore_eos=True)
    plain = LLM(str(tiny_qwen3_dir), dtype="float32").generate(prompt, params)
    llm = LLM(str(tiny_qwen3_with_head), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 3})
    head_never_right(llm, monkeypatch)
    policy, asked = llm.engine.scheduler.draft_policy, []
    real = policy.draft_length
    monkeypatch.setattr(policy, "draft_length", lambda *a: asked.append(1) or real(*a))
    outs = llm.generate(prompt, params)
    assert outs[0].outputs[0].token_ids == plain[0].outputs[0].token_ids
    assert len(asked) < 119 // 2, len(asked)


def test_the_engines_guesses_of_the_head_are_one_token_with_a_second_from_its_next_step(tiny_qwen3_dir, tiny_qwen3_with_head, monkeypatch):
    """In a running engine a guess asked of the MTP head makes one draft (no chained row), and a
    guess whose token came true asks the head's drafts with its second token (the row before the
    last): with the head right from there on the sequence verifies the step after; with its second
    tokens wrong it never does. Outputs stay plain decoding's."""
    from layerzoo import LLM, SamplingParams

    prompt = [5, 9, 14, 3, 22, 7]
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = LLM(str(tiny_qwen3_dir), dtype="float32").generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    text = prompt + list(plain)

    def run(second_right: bool):
        llm = LLM(str(tiny_qwen3_with_head), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 3})
        policy, proposer = llm.engine.scheduler.draft_policy, llm.engine.runner.mtp.proposer
        assert policy.one_token_guesses
        monkeypatch.setattr(StepCosts, "costs", lambda self: (0.0, 0.05))  # drafting pays once a guess counts
        store, store_second, made, seconds = proposer.store, proposer.store_second, [], []

        def stored(seq_id, length, drafts):  # the head: wrong at the prompt, right after it
            made.append((length, len(drafts), seq_id in proposer.second_asks))
            store(seq_id, length, text[length : length + len(drafts)] if length > len(prompt) + 1 else [-1] * len(drafts))

        def stored_second(seq_id, length, token):
            seconds.append(length)
            store_second(seq_id, length, text[length - 1] if second_right else -1)

        monkeypatch.setattr(proposer, "store", stored)
        monkeypatch.setattr(proposer, "store_second", stored_second)
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
        assert out == plain
        return made, seconds, llm.engine.stats.spec_verify_steps

    made, seconds, verifies = run(second_right=True)
    assert made[0][1] == 1 and made[1][1:] == (1, False), made  # the prompt's one draft (no chained row); then a guess of one
    assert made[2][1:] == (3, True) and seconds == [made[2][0]], (made, seconds)  # its drafts, with its second
    assert verifies > 0
    made, seconds, verifies = run(second_right=False)
    assert seconds and verifies == 0 and all(n <= 3 for _, n, _ in made[1:]), (made, seconds)


def test_a_new_sequences_first_guess_is_one_head_draft_without_chained_rows(tiny_qwen3_dir, tiny_qwen3_with_head, monkeypatch):
    """Under adaptive drafting the head's drafts after a prompt are only the sequence's first shadow
    guess (its prior drafts nothing): the head makes one there and chains no row (each chained row
    is a head step), and the guess takes the head's second token like any other. A head right from
    the prompt on still has the sequence verify from its third step, as with k drafts there; fixed-k
    speculation, which verifies the prompt's drafts at once, still gets all k."""
    from layerzoo import LLM, SamplingParams
    from layerzoo.speculative.mtp_drafter import MtpDrafter

    prompt = [5, 9, 14, 3, 22, 7]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM(str(tiny_qwen3_dir), dtype="float32").generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
    text = prompt + list(plain)
    real_chain = MtpDrafter._chain

    def run(spec):
        llm = LLM(str(tiny_qwen3_with_head), dtype="float32", speculative_config={"method": "mtp", "num_speculative_tokens": 3, **spec})
        proposer, engine = llm.engine.runner.mtp.proposer, llm.engine
        monkeypatch.setattr(StepCosts, "costs", lambda self: (0.0, 0.05))  # drafting pays once a guess counts
        store, store_second, made, chains, verified = proposer.store, proposer.store_second, [], [], []
        # The head is right everywhere: its drafts and second tokens are the plain outputs.
        monkeypatch.setattr(proposer, "store", lambda seq_id, n, drafts: made.append((n, len(drafts))) or store(seq_id, n, text[n : n + len(drafts)]))
        monkeypatch.setattr(proposer, "store_second", lambda seq_id, n, token: store_second(seq_id, n, text[n - 1]))
        monkeypatch.setattr(MtpDrafter, "_chain", lambda self, first, live, *a: chains.append(len(made)) or real_chain(self, first, live, *a))
        step = engine.step
        monkeypatch.setattr(engine, "step", lambda: verified.append(engine.stats.spec_verify_steps) or step())
        out = llm.generate([{"prompt_token_ids": prompt}], params)[0].outputs[0].token_ids
        assert out == plain
        first_verify = next(i for i, (a, b) in enumerate(zip(verified, verified[1:] + [engine.stats.spec_verify_steps])) if b > a)
        return made, chains, first_verify

    made, chains, first_verify = run({})
    assert made[0] == (len(prompt) + 1, 1) and 0 not in chains, (made, chains)  # the prompt's one draft, no chained row
    assert first_verify == 3, first_verify  # the guess (prompt), its drafts with the second (step 2), drafting (step 3)
    made, chains, first_verify = run({"adaptive": False})
    assert made[0] == (len(prompt) + 1, 3) and chains[0] == 0 and first_verify == 1, (made, chains, first_verify)
