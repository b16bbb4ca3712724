"""Adaptive draft length: per sequence, how many tokens to draft follows its recent acceptance.

A verify step of k drafts costs more than the plain decode step it replaces; it pays only when
enough drafts are accepted. With little to accept (random text, a proposer that guesses wrong)
fixed-k speculation runs slower than plain decoding. This policy keeps, per sequence, a decayed
count of accepted and rejected draft tokens, from which ``p``, the chance that the next draft is
accepted given the previous ones were. A verify of k drafts then emits ``1 + p + ... + p**k``
tokens on average and costs ``1 + fixed + k * per_draft`` of the sequence's plain steps, both
measured on the machine at hand from the engine's own steps (`layerzoo.speculative.step_cost`,
which the engine feeds; until it has measured, its prior); the policy drafts the k with the
largest expected gain beyond the margin VERIFY_COST, and none when no k gains that much.

When not even one draft gains, the sequence stops drafting (``draft_length`` returns 0). It then
runs a *shadow check*: the proposer (plain Python, no model work) still drafts, nothing is
verified, and as the sequence generates tokens the guess is scored token by token, as if it had
been verified. When the guesses start matching again the estimate rises and real drafting resumes
within a step or two. A fresh sequence starts there too: it drafts once a guess of its own came
true, so a request with nothing to copy never pays for a verify. A guess counts only once
`SHADOW_MATCH` of its tokens came true (one right token is often luck); guesses that keep missing
wait a token before the next (`SHADOW_MAX_GAP`). A proposer whose drafts come a step after the
ask (the MTP head, which runs after the step: given as ``peek``) is asked one step and its guess
peeked at the next; it is asked for drafts again the step before the guess can count (one more
right token: the drafts are ready the step it counts), and its longest wait is its own
(``shadow_max_gap``: a guess costs a head step there); its guesses that come true without making
the sequence draft wait as misses do (twice as long as the last, up to that gap). Where it can also
guess the token a step samples beside that step's drafts (``ask_second``: the MTP head's row before
the last), a guess it is asked for is one token, and its second token is that guess, asked with the
drafts the step before the guess can count: a guess that misses costs the head step alone. Such guesses
together take at most a share of the decode time (`step_cost.EXPLORE_SHARE`, measured by `StepCosts`): while it is spent none is
asked but a fresh sequence's first few (`FRESH_GUESSES`), and a sequence whose guess is due rests
until the share is earned back. Coming back costs such a proposer guesses, so a sequence of it that
drafts goes on at a smaller margin (`KEEP_MARGIN`) until verifies in a row take no draft
(`KEEP_MISSES`). Greedy outputs do not depend on any of this: verification is
exact, the policy only changes how much work each step does.

Interface (the engine calls these; state is per sequence id)::

    quiet = policy.quiet(k_max)                         # once a step: seq_id -> length below which k is 0
    k = policy.draft_length(seq_id, token_ids, k_max)   # before proposing (not quiet); 0: do not draft
    policy.observe(seq_id, drafted, accepted)          # after a verify of ``drafted`` drafts
    policy.forget(seq_id)                               # the sequence finished or was preempted
    policy.costs.observe(batch, drafts, verifiers, seconds, ...)  # after each pure decode step
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence

import attrs

from layerzoo.speculative.step_cost import PRIOR_PER_DRAFT, StepCosts

# Decay of the accepted / rejected counts per observation: about the last 1 / (1 - DECAY) verifies
# matter, so a sequence that leaves a copied span stops drafting within a few steps. At 0.6 a long
# run of accepted drafts kept it drafting for ~5 rejected verifies after the copy ended
# (bench/speculative.py's rewrite workload; see SHADOW_MATCH for what 0.5 gained with it).
DECAY = 0.5
# The same for a proposer whose drafts come a step after the ask (the MTP head): its accuracy is the
# model's own skill at the text, which moves slowly, so one rejected verify tells less than a copy
# that ended. At 0.5 a rejected verify of three drafts stopped drafting where the head's price is
# most of a sequence-step (the embedded model at one request: ~0.8), and the rewrite workload,
# request after request in one process, settled at 1.04-1.13x plain where drafting every step ran
# 1.53x; at 0.8, 1.42-1.48x.
DEFERRED_DECAY = 0.8
# The gain, in the sequence's plain decode steps, that a verify must promise beyond its measured
# cost (`StepCosts`: a fixed part and DRAFT_COST per drafted row until measured). The acceptance
# estimate is rough (a few decayed outcomes): with a margin of 0.15 a single lucky guess (p ~ 0.35)
# started a verify that rarely paid, and the low-acceptance workload ran 0.90x plain against 0.96x
# at 0.25 (Zen 5, when this was the whole fixed cost). With the measured fixed part (~0 on a 2-core
# EPYC) and no margin, that workload verified three times as often.
VERIFY_COST = 0.25
DRAFT_COST = PRIOR_PER_DRAFT
# The margin for a sequence that drafted at its last step to go on drafting, for a proposer whose
# drafts come a step after the ask (the MTP head): having stopped, it drafts again only after a
# guess came true, and each guess is a head step (with waits that grow while guesses do not start
# drafting, and the guesses' share of time), while VERIFY_COST's margin is for an estimate that a
# guess or two made. On the AVX2 build of the embedded model at one request, where the head's work
# is about a plain step, the rewrite workload's estimate fell to the stopping point in a stretch of
# rejected verifies and the sequence then drafted in 19-25 of ~40 steps where fixed k = 3 verified
# every step (0.98-1.20x plain against 1.19-1.29x), in six processes of seven; at 0.05, in 38-39 in
# each. Only until KEEP_MISSES verifies in a row took no draft: a head wrong at every first draft is
# stopped by VERIFY_COST's margin, as before (the estimate of a sequence whose verifies all fail
# falls toward 0.5 / (1 + 1 / (1 - DEFERRED_DECAY)) = 0.083, at which a small margin and a cheap
# head would keep drafting for good); the stretch above took 2, 2, 2, 1, 0, 1, 0 drafts of three.
KEEP_MARGIN = 0.05
KEEP_MISSES = 2
# Prior of a fresh sequence: as if one draft had been rejected (p = 0.25: no draft gains), so it
# starts with shadow checks and drafts once one came true (SHADOW_MATCH = 2 right: p = 0.71, k = 4).
# A prior that drafts at once (3 of 3 accepted, as before) cost a fresh sequence with nothing to
# copy about four rejected verifies before the estimate decayed.
PRIOR_ACCEPTED, PRIOR_REJECTED = 0.0, 1.0
# The longest wait, in generated tokens, between shadow guesses that keep missing. A guess costs the
# proposer's scan (~4 us for the n-gram one at 250 tokens) and no model work; waits of up to 8
# tokens missed the start of copies (the guess that would have come true was never made).
SHADOW_MAX_GAP = 2
# A shadow guess counts once this many of its tokens came true; one that misses before is scored as
# a miss and lengthens the wait (one right token is often luck: a model repeating its own recent
# tokens, a common token). Scoring single right tokens as accepted drafts restarted verifies that
# were then rejected. With DECAY 0.5 and SHADOW_MAX_GAP 2 (from 0.6, 8 and single tokens counted),
# replaying the embedded model's greedy outputs through the policy (the same tokens, every step's
# rows counted) took the rewrite workload from 78 to 75 steps and 572 to 554 drafts, and its
# low-acceptance one from 13 to 6 verifies.
SHADOW_MATCH = 2
# Guesses a fresh sequence may ask of a proposer that costs model work whatever the balance of the
# guesses' share of time (`step_cost.EXPLORE_SHARE`): its first guess (the head's drafts after its
# prompt) tells little, and at six sequences a share of 1% earns a head step back in ~100 steps, so
# stdlib modules the trained head gets right (90%) whose first guess missed never drafted.
FRESH_GUESSES = 2


@attrs.define
class SeqAcceptance:
    """One sequence's decayed draft outcomes, and its pending shadow draft while it is not drafting."""

    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED
    shadow: list[int] = attrs.field(factory=list)  # drafts guessed while not drafting
    shadow_at: int = 0  # len(token_ids) when the shadow draft was made
    shadow_scored: int = 0  # its leading tokens already scored (matched)
    shadow_misses: int = 0  # shadow guesses in a row that missed within SHADOW_RESET_MATCH tokens
    shadow_idle: int = 0  # shadow guesses since it drafted that came true without making it draft (deferred proposers)
    shadow_next: int = 0  # len(token_ids) from which the next shadow guess may be made
    asked_at: int = -1  # len(token_ids) when a deferred proposer was last asked for a guess
    fresh_guesses: int = FRESH_GUESSES  # guesses it may still ask before the share of time counts (`FRESH_GUESSES`)
    rests_until: int = 0  # the length last given to the proposer's `rest` (0: none since it was last asked)
    drafting: bool = False  # its last `draft_length` drafted (`KEEP_MARGIN`)
    missed: int = 0  # its verifies in a row that took no draft
    best: tuple[int, int, float, int] | None = None  # (k_max, costs version, margin, draft length) for the counts as they are

    def draft_length(self, k_max: int, costs: StepCosts, margin: float) -> int:
        """`best_draft_length` at the current estimate and costs, beyond ``margin`` (the policy's:
        `VERIFY_COST` or, drafting, `KEEP_MARGIN`; recomputed only after a new outcome, a new
        measurement or another margin)."""
        if self.best is None or self.best[:3] != (k_max, costs.version, margin):
            fixed, per_draft = costs.costs()
            self.best = (k_max, costs.version, margin, best_draft_length(self.acceptance(), k_max, margin + fixed, per_draft))
        return self.best[3]

    def acceptance(self) -> float:
        """Estimated chance that one more draft is accepted, given the previous ones were."""
        return (self.accepted + 0.5) / (self.accepted + self.rejected + 1.0)

    def record(self, drafted: int, accepted: int, decay: float) -> None:
        """Score a verify: ``accepted`` drafts were taken, then (if fewer than drafted) one was
        rejected; the counts so far are kept at ``decay`` (the policy's: `DECAY` or `DEFERRED_DECAY`)."""
        assert 0 <= accepted <= drafted
        self.accepted = decay * self.accepted + accepted
        self.rejected = decay * self.rejected + (1.0 if accepted < drafted else 0.0)
        self.best = None


def best_draft_length(p: float, k_max: int, verify_cost: float = VERIFY_COST, draft_cost: float = DRAFT_COST) -> int:
    """The k in 0..k_max with the largest expected gain ``p + ... + p**k - verify_cost - k * draft_cost``
    (0 when no k > 0 gains): a draft is worth its row while ``p**i >= draft_cost``."""
    best_k, best_gain, gain, term = 0, 0.0, -verify_cost, 1.0
    for k in range(1, k_max + 1):
        term *= p
        gain += term - draft_cost
        if gain > best_gain:
            best_k, best_gain = k, gain
    return best_k


class AdaptiveDraftLength:
    """The per-sequence draft-length policy (see the module docstring).

    ``propose(token_ids, k)`` is the proposer used for shadow drafts while a sequence is not
    drafting; it must be cheap (the n-gram proposer is a Python scan of the token list).
    """

    def __init__(
        self,
        propose: Callable[[Sequence[int], int], list[int]],
        adaptive: bool = True,
        *,
        propose_for: Callable[[int, Sequence[int], int], list[int]] | None = None,
        peek: Callable[[int, Sequence[int], int], list[int]] | None = None,
        rest: Callable[[int, int], None] | None = None,
        ask_second: Callable[[int], None] | None = None,
        second: Callable[[int, Sequence[int]], int | None] | None = None,
        shadow_max_gap: int | None = None,
        costs: StepCosts | None = None,
    ):
        self.propose = propose
        # ``propose_for(seq_id, token_ids, k)``: shadow drafts of a proposer that keeps them per
        # sequence (the MTP head's, made every step anyway); None: ``propose``.
        self.propose_for = propose_for
        # ``peek(seq_id, token_ids, k)``: a deferred proposer's drafts for the tokens as they are,
        # without asking for more. Its drafts come a step after the ask (the runner's MTP head
        # runs after the step): a shadow guess is asked for one step and peeked at the next.
        self.peek = peek
        # ``rest(seq_id, length)``: told a deferred proposer that no guess will be asked for the
        # sequence before it holds ``length`` tokens (the MTP runner then keeps none of its rows).
        self.rest = rest
        # ``ask_second(seq_id)`` and ``second(seq_id, token_ids)``: a deferred proposer asked, beside
        # the drafts of an ask, for its own guess at the token that step samples (the MTP head's row
        # before the last: `MtpProposer.ask_second`), and what it made. With them a guess it is asked
        # for is one token (no chained row: a miss costs the head step alone), and a guess whose
        # token came true takes that for its second, asked with its drafts the step before it can
        # count (`_ready`).
        self.ask_second, self.second = ask_second, second
        self.one_token_guesses = peek is not None and ask_second is not None and second is not None
        # The longest wait between shadow guesses that keep missing (a proposer whose guess costs
        # model work waits longer).
        self.shadow_max_gap = SHADOW_MAX_GAP if shadow_max_gap is None else shadow_max_gap
        # Guesses that keep missing wait twice as long each time, a deferred proposer's four times:
        # each of its guesses is a head step (a layer and the LM head), and a head never right
        # guessed 8 times in 128 tokens at x2 (bench/speculative.py's low-acceptance workload, one
        # request: 0.93x plain for MTP k <= 1).
        self.miss_growth = 4 if peek is not None else 2
        self.decay = DEFERRED_DECAY if peek is not None else DECAY  # of the acceptance counts
        self.keep_margin = KEEP_MARGIN if peek is not None else VERIFY_COST  # for a sequence drafting now
        self.adaptive = adaptive  # False: always k_max (fixed-k speculation, for comparison)
        # What a verify costs here, measured from the engine's steps (the engine feeds it).
        self.costs = costs if costs is not None else StepCosts()
        self.seqs: defaultdict[int, SeqAcceptance] = defaultdict(SeqAcceptance)
        self.shadow_checks = 0  # shadow drafts scored (no model work)
        self._pays_at: tuple[int, int] | None = None  # (k_max, costs version) `_may_pay` answered for
        self._pays = True
        # seq_id -> the length below which `draft_length` answers 0 and does nothing (`quiet`), for
        # the (k_max, costs version) of `_quiet_at`.
        self._quiet: dict[int, int] = {}
        self._quiet_at: tuple[int, int] | None = None

    def draft_length(self, seq_id: int, token_ids: Sequence[int], k_max: int) -> int:
        """How many drafts to propose for this sequence now (0: none this step)."""
        if not self.adaptive:
            return k_max
        if self.costs.wants_plain():  # one plain step to price the batch's verifies against
            return 0
        state = self.seqs[seq_id]
        if state.shadow and self.one_token_guesses and len(state.shadow) < SHADOW_MATCH <= len(token_ids) - state.shadow_at:
            self._second(seq_id, state, token_ids)
        counted = self._score_shadow(state, token_ids) if state.shadow else False
        keep = state.drafting and state.missed < KEEP_MISSES
        k = state.draft_length(k_max, self.costs, self.keep_margin if keep else VERIFY_COST)
        state.drafting = k > 0
        if k == 0 and state.shadow and self.peek is not None:  # a guess right so far: drafts ready?
            self._ready(seq_id, state, token_ids, k_max)
        if k > 0:  # drafting again: real verifies score it from now on
            state.shadow, state.shadow_scored, state.shadow_misses, state.shadow_idle = [], 0, 0, 0
            state.rests_until = 0  # (the scheduler asks the proposer now, which ends its rest)
            return k
        if counted and self.peek is not None:
            # A guess that came true in part or whole but does not start drafting: the next waits
            # twice as long as after the last such one (up to the proposer's gap). A deferred
            # proposer's guess is a head step (with its chained rows): guessing again at once ran
            # the head in 79 of 128 steps of the rewrite workload (MTP k <= 3, ~60% accepted), 0.6x plain.
            state.shadow_idle += 1
            state.shadow_next = max(state.shadow_next, len(token_ids) + self._wait(state.shadow_idle, 2) - 1)
        pays = self._may_pay(k_max)
        if not state.shadow and k_max > 0 and len(token_ids) >= state.shadow_next and pays:
            self._guess(seq_id, state, token_ids, k_max)
        if self.rest is not None and not state.shadow and state.asked_at != len(token_ids):
            # Nothing pending: the next guess waits for its gap, or, while none could pay, at least
            # the longest gap (a change of costs may guess sooner, without the rows before it),
            # told again when half of it is left.
            until = state.shadow_next
            if not pays:
                far = state.rests_until >= len(token_ids) + self.shadow_max_gap // 2
                until = state.rests_until if far else len(token_ids) + self.shadow_max_gap
            if until != state.rests_until:
                self.rest(seq_id, until)
                state.rests_until = until
        if not state.shadow and self._quiet_at == (k_max, self.costs.version):
            self._quiet[seq_id] = self._quiet_until(state, pays)
        return k

    def quiet(self, k_max: int) -> dict[int, int]:
        """Per sequence, the length below which `draft_length` (at ``k_max``, or fewer) would answer
        0 with nothing to do: no guess pending or due, and the runner told when the next may come
        (or, while no draft could pay, well before the rest it was given runs out). The scheduler
        takes it once a step and asks `draft_length` (building the token list) only for sequences
        not under it: most steps of a sequence that does not draft cost it a lookup. Filled by
        `draft_length` and emptied when the costs move (every length may change), unless no draft
        could pay before nor after: then every length is the runner's rest, which no cost moves
        (six sequences of the embedded model, where the costs moved every few steps and each time
        every sequence built its token list and asked `draft_length` again: ~100 asks a run)."""
        key = (k_max, self.costs.version)
        if self._quiet_at != key:
            idle = self._quiet_at is not None and self._quiet_at[0] == k_max and self._pays_at == self._quiet_at and not self._pays
            if not idle or self._may_pay(k_max):
                self._quiet.clear()
            self._quiet_at = key
        return self._quiet

    def _quiet_until(self, state: SeqAcceptance, pays: bool) -> int:
        """`quiet`'s length for a sequence `draft_length` just answered 0 with no guess pending."""
        told = self.rest is None  # (a proposer without `rest` needs no word)
        if pays:
            return state.shadow_next if told or state.shadow_next == state.rests_until else 0
        return 1 << 62 if told else state.rests_until - self.shadow_max_gap // 2 + 1

    def _wait(self, count: int, growth: int) -> int:
        """Tokens before the next guess after ``count`` guesses in a row that did not start drafting:
        1 after the first, ``growth`` times the last after each further one, at most the proposer's gap."""
        return min(growth ** max(count - 1, 0), self.shadow_max_gap)

    def _may_pay(self, k_max: int) -> bool:
        """Whether drafting can pay at the current costs: a sequence whose every draft is accepted
        would draft. When not, no shadow guess could start drafting (the MTP head's cost a head step
        each): none is made until the costs move (the fit relaxes toward the prior while nothing
        verifies, the batch changes). On a 2-core EPYC a verify of six sequences' drafts costs about
        its rows (the fp32 GEMV at 6 rows is compute-bound: 24 rows take 3.4x as long), which the
        MTP head's chained rows and step push past anything its drafts can emit."""
        key = (k_max, self.costs.version)
        if self._pays_at != key:
            fixed, per_draft = self.costs.costs()
            accepted = k_max / (1 - self.decay)  # (`SeqAcceptance.acceptance` of a sequence that never missed)
            best = (accepted + 0.5) / (accepted + 1.0)
            self._pays = best_draft_length(best, k_max, VERIFY_COST + fixed, per_draft) > 0
            self._pays_at = key
        return self._pays

    def _second(self, seq_id: int, state: SeqAcceptance, token_ids: Sequence[int]) -> None:
        """A one-token guess whose token came true takes the proposer's second token (asked with the
        drafts the step before, `_ready`) for its next; without one (none asked: the guesses' share
        was spent) it is dropped unscored, and the next guess may come now."""
        token = self.second(seq_id, token_ids) if len(token_ids) == state.shadow_at + len(state.shadow) + 1 else None
        if token is None:
            state.shadow, state.shadow_scored = [], 0
            return
        state.shadow = [*state.shadow, token]

    def _ready(self, seq_id: int, state: SeqAcceptance, token_ids: Sequence[int], k_max: int) -> None:
        """Ask a deferred proposer for drafts the step before its pending guess can count (one more
        right token): should it count, the sequence drafts at once with them (its drafts come a
        step after the ask). Not for a guess after one that came true without making it draft, nor,
        before any of its tokens came true (a one-token guess), after one that missed. Asked when
        the guess was made, as before, the drafts of a guess that needs two right tokens were a step
        old when it counted, and each guess of a fresh sequence or one that stopped drafting paid
        for a head step, right or not. A one-token guess (`one_token_guesses`) asks its second token
        here too, whatever came before: without it the guess cannot count (after a guess that came
        true without making the sequence draft, with one draft: no chained rows)."""
        since = len(token_ids) - state.shadow_at  # its tokens generated so far, all right (it is pending)
        short = self.one_token_guesses and len(state.shadow) < SHADOW_MATCH
        need = SHADOW_MATCH if short else min(SHADOW_MATCH, len(state.shadow))
        if (state.shadow_idle and not short) or since + 1 != need or (not since and state.shadow_misses):
            return
        if state.fresh_guesses:
            state.fresh_guesses -= 1
        elif not self.costs.may_guess():
            return  # (the guesses' share is spent: should it count, the sequence drafts a step later)
        self._ask(seq_id, state, token_ids, 1 if state.shadow_idle else k_max)
        if short:
            self.ask_second(seq_id)

    def _ask(self, seq_id: int, state: SeqAcceptance, token_ids: Sequence[int], k: int) -> None:
        """Ask a deferred proposer for ``k`` drafts for a guess: a head step after this one, which
        the guesses' share of time pays for (`StepCosts.guesses`); the ask ends the sequence's rest."""
        self.propose_for(seq_id, token_ids, k)
        self.costs.guesses += 1
        state.rests_until = 0

    def _guess(self, seq_id: int, state: SeqAcceptance, token_ids: Sequence[int], k_max: int) -> None:
        """Make the shadow guess (a deferred proposer: ask now, peek at the next token)."""
        length = state.shadow_at = len(token_ids)
        if self.peek is not None:
            state.shadow = self.peek(seq_id, token_ids, k_max)
            if not state.shadow and state.asked_at != length - 1:  # ask; the guess comes next step
                if state.fresh_guesses:
                    state.fresh_guesses -= 1
                elif not self.costs.may_guess():  # guesses have spent their share of the time: not yet
                    state.shadow_next = length + self.costs.guess_wait()  # (its rows need not wait meanwhile)
                    return
                # As long as scoring needs: one token where the proposer adds the second (`_ready`).
                self._ask(seq_id, state, token_ids, 1 if self.one_token_guesses else min(k_max, SHADOW_MATCH))
                state.asked_at, state.shadow_next = length, length + 1
                return
            if state.shadow:
                self._ready(seq_id, state, token_ids, k_max)
        elif self.propose_for is not None:
            state.shadow = self.propose_for(seq_id, token_ids, k_max)
            state.rests_until = 0
        else:
            state.shadow = self.propose(token_ids, k_max)
        if not state.shadow:  # nothing to guess from (no n-gram match): wait as after a miss
            state.shadow_next = length + self.shadow_max_gap

    def observe(self, seq_id: int, drafted: int, accepted: int) -> None:
        """A verify of ``drafted`` drafts accepted ``accepted`` of them."""
        if drafted:
            state = self.seqs[seq_id]
            state.record(drafted, accepted, self.decay)
            state.missed = 0 if accepted else state.missed + 1

    def forget(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)
        self._quiet.pop(seq_id, None)

    def _score_shadow(self, state: SeqAcceptance, token_ids: Sequence[int]) -> bool:
        """Score the shadow draft against the tokens generated since it was made, token by token:
        once `SHADOW_MATCH` came true each matched token counts as an accepted draft and the first
        mismatch as a rejection; a guess wrong before that counts as one rejection. True when this
        call counted tokens of a guess that came true that far."""
        if len(token_ids) < state.shadow_at + state.shadow_scored:  # rewound (watchdog): drop the guess
            state.shadow, state.shadow_scored = [], 0
            return False
        actual = token_ids[state.shadow_at : state.shadow_at + len(state.shadow)]
        matched = state.shadow_scored
        while matched < len(actual) and actual[matched] == state.shadow[matched]:
            matched += 1
        missed = matched < len(actual)
        enough = SHADOW_MATCH if self.one_token_guesses else min(SHADOW_MATCH, len(state.shadow))
        if not missed and (matched == state.shadow_scored or matched < enough):
            return False  # nothing new, or right so far but too few tokens to tell a copy from luck
        if matched < enough:  # wrong within its first SHADOW_MATCH tokens: one miss
            state.record(1, 0, self.decay)
        else:
            state.record(matched - state.shadow_scored + missed, matched - state.shadow_scored, self.decay)
        self.shadow_checks += 1
        if missed:  # early misses in a row wait longer before the next guess
            state.shadow_misses = state.shadow_misses + 1 if matched < enough else 0
            state.shadow_next = len(token_ids) + self._wait(state.shadow_misses, self.miss_growth) - 1
        state.shadow_scored = matched
        if missed or matched == len(state.shadow):
            state.shadow, state.shadow_scored = [], 0
        return matched >= enough
