"""Adaptive draft length: per sequence, how many tokens to draft follows its recent acceptance.

A verify step of k drafts costs more than the plain decode step it replaces; it pays only when
enough drafts are accepted. With little to accept (random text, a proposer that guesses wrong)
fixed-k speculation runs slower than plain decoding. This policy keeps, per sequence, a decayed
count of accepted and rejected draft tokens and drafts only as many tokens as are likely to be
accepted: draft token i is worth verifying when the estimated chance that drafts 1..i are all
accepted, ``p ** i``, is at least ``worth`` (the relative cost of one more verified token).

When the estimate falls so low that not even one draft is worth it, the sequence stops drafting
(``draft_length`` returns 0). It then runs a *shadow check*: the proposer (plain Python, no model
work) still drafts, nothing is verified, and once the sequence has generated the tokens the
shadow draft guessed, the guess is scored as if it had been verified. When the guesses start
matching again the estimate rises and real drafting resumes. Greedy outputs do not depend on any
of this: verification is exact, the policy only changes how much work each step does.

Interface (the engine calls these; state is per sequence id)::

    k = policy.draft_length(seq_id, token_ids, k_max)   # before proposing; 0: do not draft
    policy.observe(seq_id, drafted, accepted)          # after a verify of ``drafted`` drafts
    policy.forget(seq_id)                               # the sequence finished or was preempted
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import attrs

# Decay of the accepted / rejected counts per observation: about the last 1 / (1 - DECAY) verifies
# matter, so a sequence that leaves a copied span stops drafting within a few steps.
DECAY = 0.6
# Draft token i is proposed when P(drafts 1..i accepted) >= WORTH. On CPU a verify of k drafts
# costs well over a decode step (measured with bench/speculative.py); 0.5 keeps speculation where
# acceptance is high (copying spans) and drops it where it is below ~50%.
WORTH = 0.5
# Prior of a fresh sequence: as if 5 of 5 drafts had been accepted (acceptance 6/7: k = 4 at once).
PRIOR_ACCEPTED, PRIOR_REJECTED = 5.0, 0.0


@attrs.define
class SeqAcceptance:
    """One sequence's decayed draft outcomes, and its pending shadow draft while it is not drafting."""

    accepted: float = PRIOR_ACCEPTED
    rejected: float = PRIOR_REJECTED
    shadow: list[int] = attrs.field(factory=list)  # drafts guessed while not drafting
    shadow_at: int = 0  # len(token_ids) when the shadow draft was made

    def acceptance(self) -> float:
        """Estimated chance that one more draft is accepted, given the previous ones were (Laplace)."""
        return (self.accepted + 1.0) / (self.accepted + self.rejected + 2.0)

    def record(self, drafted: int, accepted: int) -> None:
        """Score a verify: ``accepted`` drafts were taken, then (if fewer than drafted) one was rejected."""
        assert 0 <= accepted <= drafted
        self.accepted = DECAY * self.accepted + accepted
        self.rejected = DECAY * self.rejected + (1.0 if accepted < drafted else 0.0)


def worth_drafting(acceptance: float, k_max: int, worth: float = WORTH) -> int:
    """The largest k <= k_max with ``acceptance ** k >= worth`` (0 when not even one draft is)."""
    if k_max <= 0 or acceptance < worth:
        return 0
    if acceptance >= 1.0:
        return k_max
    return min(k_max, int(math.log(worth) / math.log(acceptance)))


class AdaptiveDraftLength:
    """The per-sequence draft-length policy (see the module docstring).

    ``propose(token_ids, k)`` is the proposer used for shadow drafts while a sequence is not
    drafting; it must be cheap (the n-gram proposer is a Python scan of the token list).
    """

    def __init__(self, propose: Callable[[Sequence[int], int], list[int]], worth: float = WORTH, adaptive: bool = True):
        assert 0.0 < worth < 1.0
        self.propose = propose
        self.worth = worth
        self.adaptive = adaptive  # False: always k_max (fixed-k speculation, for comparison)
        self.seqs: dict[int, SeqAcceptance] = {}
        self.shadow_checks = 0  # shadow drafts scored (no model work)

    def draft_length(self, seq_id: int, token_ids: Sequence[int], k_max: int) -> int:
        """How many drafts to propose for this sequence now (0: none this step)."""
        if not self.adaptive:
            return k_max
        state = self.seqs.setdefault(seq_id, SeqAcceptance())
        self._score_shadow(state, token_ids)
        k = worth_drafting(state.acceptance(), k_max, self.worth)
        if k == 0 and not state.shadow and k_max > 0:
            state.shadow = self.propose(token_ids, k_max)
            state.shadow_at = len(token_ids)
        return k

    def observe(self, seq_id: int, drafted: int, accepted: int) -> None:
        """A verify of ``drafted`` drafts accepted ``accepted`` of them."""
        if drafted:
            self.seqs.setdefault(seq_id, SeqAcceptance()).record(drafted, accepted)

    def forget(self, seq_id: int) -> None:
        self.seqs.pop(seq_id, None)

    def _score_shadow(self, state: SeqAcceptance, token_ids: Sequence[int]) -> None:
        """Once the tokens a shadow draft guessed have been generated (or one differs), score it."""
        if not state.shadow:
            return
        actual = token_ids[state.shadow_at : state.shadow_at + len(state.shadow)]
        if len(token_ids) < state.shadow_at:  # the sequence was rewound (watchdog): drop the guess
            state.shadow = []
            return
        matched = 0
        while matched < len(actual) and actual[matched] == state.shadow[matched]:
            matched += 1
        if matched < len(actual) or len(actual) == len(state.shadow):
            state.record(len(state.shadow), matched)
            state.shadow = []
            self.shadow_checks += 1
