"""The scheduler's side of MTP drafting: `MtpProposer` hands out the runner's drafts only while they
follow the sequence's tokens, through the ``propose_for`` path the scheduler and the adaptive
policy's shadow checks take; the ``"mtp"`` method is registered."""

from layerzoo.speculative import SpeculativeConfig, build_proposer
from layerzoo.speculative.adaptive import AdaptiveDraftLength
from layerzoo.speculative.mtp import MtpProposer
from layerzoo.speculative.proposers import NgramProposer, propose_for


def test_mtp_is_a_registered_method_with_a_lookahead_of_k_minus_one():
    proposer = build_proposer(SpeculativeConfig(method="mtp", num_speculative_tokens=4))
    assert isinstance(proposer, MtpProposer) and proposer.lookahead == 3


def test_a_new_sequence_gets_one_head_draft_under_adaptive_drafting_and_k_under_fixed():
    """After its prompt a new sequence's drafts are a shadow guess under adaptive drafting (one
    draft, no chained row), and verified at once under fixed k (all k)."""
    adaptive = build_proposer(SpeculativeConfig(method="mtp", num_speculative_tokens=4))
    fixed = build_proposer(SpeculativeConfig(method="mtp", num_speculative_tokens=4, adaptive=False))
    assert adaptive.drafts_now(9) and adaptive.wanted(9) == 1 and fixed.wanted(9) == 4
    propose_for(adaptive, 9, [1, 2, 3], 3)  # asked: as many as the schedule asks
    assert adaptive.wanted(9) == 3


def test_drafts_are_handed_out_per_sequence_only_for_the_length_they_follow():
    p = MtpProposer(3)
    p.store(7, 5, [11, 12, 13])
    assert propose_for(p, 7, [1, 2, 3, 4, 5], 2) == [11, 12]
    assert propose_for(p, 7, [1, 2, 3, 4, 5, 6], 3) == []  # the sequence moved on (or was rewound)
    assert propose_for(p, 8, [1, 2, 3, 4, 5], 3) == []  # another sequence
    assert p.propose([1, 2, 3, 4, 5], 3) == []  # without the sequence there is nothing to hand out
    p.forget(7)
    assert propose_for(p, 7, [1, 2, 3, 4, 5], 3) == []


def test_propose_for_falls_back_to_propose_for_other_proposers():
    class Bare:  # a third-party proposer written before propose_for existed
        def propose(self, token_ids, k):
            return [token_ids[-1]] * k

    assert propose_for(Bare(), 1, [4, 9], 2) == [9, 9]
    assert propose_for(NgramProposer(), 1, [1, 2, 1], 2) == NgramProposer().propose([1, 2, 1], 2)


def test_adaptive_shadow_checks_ask_the_sequence_s_own_drafts():
    p = MtpProposer(3)
    policy = AdaptiveDraftLength(p.propose, propose_for=lambda seq_id, ids, k: propose_for(p, seq_id, ids, k))
    tokens = [5, 6, 7]
    p.store(1, 3, [8, 9, 10])
    assert policy.draft_length(1, tokens, 3) == 0  # a fresh sequence shadow-checks first
    assert policy.seqs[1].shadow == [8, 9, 10]  # ... the head's drafts, not an empty guess
    assert policy.draft_length(1, tokens + [8, 9, 10], 3) > 0  # they came true: drafting starts


def test_prompt_lookup_keys_are_refused_for_mtp():
    import pytest

    from layerzoo.errors import UserError

    with pytest.raises(UserError, match=r"speculative_config\.prompt_lookup_max: only the 'ngram' method"):
        SpeculativeConfig.parse({"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3})
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}).prompt_lookup_max == 3


def test_mtp_is_refused_for_a_checkpoint_without_a_head(tiny_qwen3_dir):
    """A Qwen3 checkpoint whose config declares no MTP layers (the embedded model ships one)."""
    import pytest

    from layerzoo import LLM
    from layerzoo.errors import UserError

    with pytest.raises(UserError, match=r"'mtp' .*Qwen3ForCausalLM has none here \(its config declares no MTP layers\); use method 'ngram'"):
        LLM(tiny_qwen3_dir, speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_the_head_runs_for_a_sequence_only_when_asked_and_its_drafts_come_a_step_later():
    p = MtpProposer(3)
    assert p.drafts_now(5)  # new to drafting: its prompt's last row drafts
    p.store(5, 10, [1, 2, 3])
    p.step_done()
    assert not p.drafts_now(5)  # nobody asked in the last schedule: the head does not run for it
    assert p.peek(5, list(range(10)), 3) == [1, 2, 3] and not p.drafts_now(5)  # a peek does not ask
    assert propose_for(p, 5, list(range(11)), 3) == []  # asked after a step without drafts: none ...
    assert p.drafts_now(5)  # ... and the runner drafts for it this step
    p.store(5, 12, [4, 5, 6])
    p.step_done()
    assert propose_for(p, 5, list(range(12)), 3) == [4, 5, 6]
    p.forget(5)
    assert p.drafts_now(5) and propose_for(p, 5, list(range(12)), 3) == []


def test_a_deferred_shadow_guess_is_asked_once_peeked_next_step_and_misses_wait_longer():
    """The MTP head's guess comes a step after the ask: the policy asks (the head runs for the
    sequence after that step) and peeks the next step, asking again there only while no guess
    missed (drafts ready should it come true); after guesses that keep missing it waits four times
    as long each time (a guess is a head step), up to the proposer's gap between asks."""
    p = MtpProposer(1)
    policy = AdaptiveDraftLength(p.propose, propose_for=lambda s, ids, k: propose_for(p, s, ids, k), peek=p.peek,
                                 shadow_max_gap=p.shadow_max_gap)
    tokens, asks = list(range(10)), []
    for _ in range(200):
        assert policy.draft_length(1, tokens, 1) == 0  # always wrong: never drafts
        if 1 in p.asked:  # the runner runs the head for it after this step: a wrong guess
            asks.append(len(tokens))
            p.store(1, len(tokens) + 1, [-1])
        p.step_done()
        tokens.append(len(tokens))
    gaps = [b - a for a, b in zip(asks, asks[1:])]
    assert gaps[:4] == [1, 5, 17, 65] and max(gaps) == p.shadow_max_gap + 1, gaps  # each wait 4x the last
    assert len(asks) - 1 <= policy.shadow_checks <= len(asks)  # each ask's guess was peeked and scored


def test_the_head_chains_as_many_drafts_as_the_step_asked_for():
    p = MtpProposer(3)
    assert p.wanted(5) == 3  # new to drafting: all k
    p.store(5, 10, [1, 2, 3])
    p.step_done()
    assert propose_for(p, 5, list(range(10)), 1) == [1]
    assert p.wanted(5) == 1  # an adaptive draft of one: no chained rows
    propose_for(p, 5, list(range(10)), 2)
    assert p.wanted(5) == 2
    p.step_done()
    assert p.wanted(5) == 3 and not p.drafts_now(5)


def test_guesses_that_come_true_without_making_it_draft_wait_longer():
    """A head whose guesses come true in part (two right, the third wrong) where verifies cost too
    much to draft on that (though guesses that all come true would): each guess is a head step, so
    the next one waits twice as long as the last (up to the proposer's gap), and none asks for the
    full k (chained rows)."""
    from layerzoo.speculative.step_cost import StepCosts

    costs = StepCosts()
    for _ in range(40):  # a draft row 0.6 of a sequence-step: 2 of 3 right does not pay, 3 of 3 would
        costs.observe(6, 0, 0, 0.001)
        costs.observe(6, 12, 6, 0.001 + 12 * 0.0001)
    p = MtpProposer(3)
    policy = AdaptiveDraftLength(p.propose, propose_for=lambda s, ids, k: propose_for(p, s, ids, k), peek=p.peek,
                                 shadow_max_gap=p.shadow_max_gap, costs=costs)
    tokens, asks = list(range(10)), []  # the sequence goes on counting: the token at position i is i
    for _ in range(400):
        assert policy.draft_length(1, tokens, 3) == 0
        if 1 in p.asked:  # the runner drafts for it after this step: two right, then a wrong one
            asks.append((len(tokens), p.wanted(1)))
            n = len(tokens) + 1
            p.store(1, n, [n, n + 1, -1])
        p.step_done()
        tokens.append(len(tokens))
    gaps = [b - a for (a, _), (b, _) in zip(asks, asks[1:])]
    assert gaps[-1] > gaps[0] and max(gaps) >= p.shadow_max_gap, gaps
    assert len(asks) < 25 and all(wanted < 3 for _, wanted in asks[2:]), asks  # (the first peek asks for all k)


def test_no_guess_is_made_while_no_acceptance_could_pay_for_a_verify():
    """Where a verify costs more than even drafts that all come true would emit (the MTP head's
    step and chained rows beside verify rows that cost what plain rows do), a shadow guess could
    not start drafting: the head is not asked for one. Cheaper costs (the batch shrank) bring the
    guesses back, and drafting with them."""
    from layerzoo.speculative.step_cost import StepCosts

    costs = StepCosts()
    for _ in range(40):  # every draft row as dear as a whole sequence-step: nothing pays
        costs.observe(6, 0, 0, 0.0012)
        costs.observe(6, 12, 6, 0.0012 + 12 * 0.0002)
    p = MtpProposer(3)
    policy = AdaptiveDraftLength(p.propose, propose_for=lambda s, ids, k: propose_for(p, s, ids, k), peek=p.peek,
                                 shadow_max_gap=p.shadow_max_gap, costs=costs)
    p.store(1, 10, [10, 11, 12])  # the prompt's head step (every new sequence runs it): a guess that comes true
    p.step_done()
    tokens, asks, drafted = list(range(10)), [], []

    def step():
        k = policy.draft_length(1, tokens, 3)
        if 1 in p.asked:  # the runner drafts for it after this step: always right
            asks.append(len(tokens))
            n = len(tokens) + 1 + k
            p.store(1, n, list(range(n, n + 3)))
        if k:
            drafted.append(k)
            policy.observe(1, k, k)
            tokens.extend(range(len(tokens), len(tokens) + k))
        p.step_done()
        tokens.append(len(tokens))

    for _ in range(60):
        step()
    assert asks == [] and drafted == [], (asks, drafted)
    for _ in range(10):  # one sequence left: a draft row is now a sixth of what it was per token
        costs.observe(1, 0, 0, 0.0008)
    for _ in range(20):
        step()
    assert asks and drafted, (asks, drafted)


def test_drafts_for_a_guess_are_asked_the_step_before_it_can_count():
    """A guess of the head counts once two of its tokens came true: its drafts are asked the step
    before (one right so far), so the sequence verifies with them the step it counts; a guess whose
    first token misses costs no second head step. Asked when the guess was peeked, as before, the
    drafts were a step old when it counted (the first verify a step later) and every guess of a
    fresh sequence paid for the ask, right or not."""
    def run(right: bool):
        p = MtpProposer(3)
        policy = AdaptiveDraftLength(p.propose, propose_for=lambda s, ids, k: propose_for(p, s, ids, k), peek=p.peek,
                                     shadow_max_gap=p.shadow_max_gap)
        text = list(range(100, 300))  # what the model generates
        length, asks, verifies = 10, [], []
        while length < 40:
            tokens = text[:length]
            k = policy.draft_length(1, tokens, 3)
            drafts = propose_for(p, 1, tokens, k) if k else []
            if 1 in p.asked:  # the runner runs the head for it after this step
                asks.append(length)
                p.store(1, length + 1, text[length + 1 : length + 4] if right else [-1, -1, -1])
            p.step_done()
            if drafts:
                verifies.append(length)
                policy.observe(1, len(drafts), len(drafts))
                length += len(drafts)
            length += 1
        return asks, verifies

    asks, verifies = run(right=True)
    assert asks[:2] == [10, 12] and verifies[0] == 13  # asked at 12, one right: verifies at 13 with them
    asks, verifies = run(right=False)
    assert asks[0] == 10 and 11 not in asks and not verifies


def test_a_guess_right_so_far_asks_for_its_drafts_only_while_the_guesses_share_allows():
    """The drafts for a guess right so far (asked the step before it can count) are a head step like
    the guess: past a fresh sequence's `FRESH_GUESSES`, none is asked while the guesses' share of
    time is spent, and a guess that counts then drafts a step later. Asked regardless, right guesses
    that did not make the sequence draft ran the head on a spent share, and its debt (head steps of
    ~1.8 ms on the embedded model's AVX2 path) held off every later guess for hundreds of steps."""
    from layerzoo.speculative.step_cost import StepCosts

    def run(share: bool):
        p = MtpProposer(3)
        costs = StepCosts()
        costs.observe(1, 0, 0, 0.001)
        costs.explore = 0.001 if share else -0.001
        policy = AdaptiveDraftLength(p.propose, propose_for=lambda s, ids, k: propose_for(p, s, ids, k), peek=p.peek,
                                     shadow_max_gap=p.shadow_max_gap, costs=costs)
        policy.seqs[1].fresh_guesses = 0
        text = list(range(100, 300))
        p.store(1, 10, text[10:13])  # the drafts of the step before (a free guess: peeked, not asked)
        asks = []
        for length in (10, 11):
            policy.draft_length(1, text[:length], 3)
            asks += [length] if 1 in p.asked else []
            p.step_done()
        return asks

    assert run(share=True) == [11]  # one right so far: its drafts are asked
    assert run(share=False) == []


def test_a_fresh_sequence_asks_for_a_guess_s_drafts_past_the_share_only_its_fresh_guesses():
    """A fresh sequence's first `FRESH_GUESSES` asks go whatever the guesses' share of time, the
    drafts for a guess right so far among them: each spends one. Guesses peeked for free (a verify's
    drafts) whose drafts were then asked spent none, so such a sequence ran the head on a spent share
    every few tokens and the share's debt grew without end (-88 ms over 14 requests of the rewrite
    workload, each later guess held off)."""
    from layerzoo.speculative.adaptive import FRESH_GUESSES
    from layerzoo.speculative.step_cost import StepCosts

    p = MtpProposer(3)
    costs = StepCosts()
    costs.observe(1, 0, 0, 0.001)
    costs.explore = -0.001
    policy = AdaptiveDraftLength(p.propose, propose_for=lambda s, ids, k: propose_for(p, s, ids, k), peek=p.peek,
                                 shadow_max_gap=p.shadow_max_gap, costs=costs)
    text, asks = list(range(100, 400)), 0
    for length in range(10, 200):
        p.store(1, length, [text[length], -1, -1])  # drafts there for free: right for one token, then wrong
        policy.draft_length(1, text[:length], 3)
        asks += 1 in p.asked
        p.step_done()
    assert asks == FRESH_GUESSES, asks


def _policy_with_seconds(p: MtpProposer, **kw) -> AdaptiveDraftLength:
    """The adaptive policy as the engine builds it for the MTP proposer."""
    return AdaptiveDraftLength(p.propose, propose_for=lambda s, ids, k: propose_for(p, s, ids, k), peek=p.peek,
                               rest=p.rest, ask_second=p.ask_second, second=p.second, shadow_max_gap=p.shadow_max_gap, **kw)


def test_a_guess_asked_of_the_head_is_one_token_and_its_second_comes_from_the_heads_next_step():
    """A guess asked of the head is one draft (no chained row: a miss costs the head step alone).
    Once its token came true, its drafts are asked with the head's own guess at the token that step
    samples (its row before the last, `MtpProposer.ask_second`); the guess counts when that came
    true too, and the sequence verifies the step it counts, with those drafts. Without a proposer
    that gives second tokens, a guess asks for both of its tokens (a chained row)."""
    def run(second_right: bool, with_seconds: bool = True):
        p = MtpProposer(3)
        policy = _policy_with_seconds(p) if with_seconds else AdaptiveDraftLength(
            p.propose, propose_for=lambda s, ids, k: propose_for(p, s, ids, k), peek=p.peek, shadow_max_gap=p.shadow_max_gap)
        text = list(range(100, 300))  # what the model generates
        p.store(1, 10, [-1, -1, -1])  # the prompt's drafts: a wrong first guess
        p.step_done()
        length, asks, verifies = 10, [], []
        while length < 30 and not verifies:
            tokens = text[:length]
            k = policy.draft_length(1, tokens, 3)
            drafts = propose_for(p, 1, tokens, k) if k else []
            if 1 in p.asked:  # the runner runs the head for it after this step
                asks.append((length, p.wanted(1), 1 in p.second_asks))
                p.store(1, length + 1, text[length + 1 : length + 1 + p.wanted(1)])
                if 1 in p.second_asks:
                    p.store_second(1, length + 1, text[length] if second_right else -1)
            p.step_done()
            if drafts:
                verifies.append((length, drafts))
                policy.observe(1, len(drafts), len(drafts))
            length += 1
        return asks, verifies

    asks, verifies = run(second_right=True)
    # Asked at 11 (the prompt's guess missed), one draft; right at 13: its drafts and second asked;
    # the second right at 14: it verifies there with them (and asks for the next drafts).
    assert asks[:2] == [(11, 1, False), (13, 3, True)] and asks[2][0] == 14, asks
    assert verifies == [(14, [114, 115, 116])], verifies
    asks, verifies = run(second_right=False)
    assert asks[:2] == [(11, 1, False), (13, 3, True)] and not verifies
    asks, _ = run(second_right=True, with_seconds=False)
    assert asks[0] == (11, 2, False)  # both tokens of the guess from the head: a chained row


def test_a_guess_whose_second_was_not_asked_is_dropped_unscored():
    """Where the drafts for a one-token guess right so far were not asked (the guesses' share of
    time is spent, past the fresh guesses), nothing gives its second token: the guess is dropped,
    neither a hit nor a miss, and the next guess is tried at once (here held off by the share)."""
    from layerzoo.speculative.step_cost import StepCosts

    p = MtpProposer(3)
    costs = StepCosts()
    costs.observe(1, 0, 0, 0.001)
    costs.explore = -0.001
    policy = _policy_with_seconds(p, costs=costs)
    state = policy.seqs[1]
    state.fresh_guesses = 0
    text = list(range(100, 300))
    p.store(1, 10, [text[10]])  # a one-token guess, free (the drafts of the step before)
    before = (state.accepted, state.rejected)
    for length in (10, 11, 12):
        policy.draft_length(1, text[:length], 3)
        assert 1 not in p.asked and 1 not in p.second_asks  # the share is spent: nothing asked
        p.step_done()
    assert state.shadow == [] and (state.accepted, state.rejected) == before and state.shadow_misses == 0
    assert state.shadow_at == 12 and state.shadow_next == 12 + costs.guess_wait()  # tried at once, waits for the share
