"""The loop watchdog: re-steers a generation stuck repeating itself.

After each step it looks at the tail of every running sequence's output. When the last tokens are
one short unit repeated back to back (``the list of the list of the list of``), it rewinds the
sequence with ``rollback_to_boundary`` to the last boundary token before the loop (a newline or a
sentence end; the prompt's end when there is none) and lets it continue with a stronger repetition
penalty. It declines, and counts why, when:

* ``streamed``: text past the boundary was already sent to the caller;
* ``cap``: the request was already re-steered ``max_rollbacks`` times;
* ``not_rewindable``: a layer keeps state the rollback cannot rewind (its name is logged).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from collections.abc import Sequence as Seq

import attrs

from layerzoo.errors import LayerStateNotRewindable
from layerzoo.runtime.sequence import Sequence
from layerzoo.tokenization.tokenizer import Tokenizer

log = logging.getLogger(__name__)

BOUNDARY_ENDINGS = ("\n", ".", "!", "?", "。")


@attrs.frozen(kw_only=True)
class WatchdogConfig:
    min_repeats: int = 3  # the unit must occur this many times back to back
    max_period: int = 16  # longest repeating unit looked for, in tokens
    min_loop_tokens: int = 8  # shorter loops ("!!!") are left alone
    max_rollbacks: int = 2  # re-steers per request
    penalty_factor: float = 1.5  # repetition penalty after a re-steer (multiplied in)


def loop_start(tokens: Seq[int], config: WatchdogConfig) -> int | None:
    """Where the repetition at the end of ``tokens`` begins, or None when the tail is not a loop.

    The tail is a loop when its last ``period`` tokens occur ``min_repeats`` times back to back
    for some period up to ``max_period``; the start is extended back over partial repeats.
    """
    n = len(tokens)
    best = None
    for period in range(1, config.max_period + 1):
        span = period * config.min_repeats
        if span > n or span < config.min_loop_tokens:
            continue
        tail = tokens[n - span :]
        if all(tail[i] == tail[i % period] for i in range(span)):
            start = n - span
            while start > 0 and tokens[start - 1] == tokens[start - 1 + period]:
                start -= 1
            best = start if best is None else min(best, start)
    return best


def boundary_token_ids(tokenizer: Tokenizer) -> frozenset[int]:
    """Ids whose text ends a line or a sentence."""
    ids = set()
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id], skip_special_tokens=True)
        if text.rstrip(" ").endswith(BOUNDARY_ENDINGS):
            ids.add(token_id)
    return frozenset(ids)


class BoundaryTokens:
    """The tokens a re-steer may rewind to (line and sentence ends), and which sequences it watches.

    Shared by the watchdog and the scheduler, which takes a rollback-ring snapshot before each such
    token is fed; the vocabulary is decoded once, on first need.
    """

    def __init__(self, tokenizer: Tokenizer, enabled_by_default: bool = False):
        self.tokenizer = tokenizer
        self.enabled_by_default = enabled_by_default
        self._ids: frozenset[int] | None = None

    @property
    def ids(self) -> frozenset[int]:
        if self._ids is None:
            self._ids = boundary_token_ids(self.tokenizer)
        return self._ids

    def applies_to(self, seq: Sequence) -> bool:
        flag = seq.params.loop_watchdog
        return self.enabled_by_default if flag is None else flag

    def before(self, seq: Sequence, position: int) -> bool:
        """Whether the token at ``position`` is one a re-steer of ``seq`` may rewind to."""
        return self.applies_to(seq) and seq.token_at(position) in self.ids


@attrs.frozen
class Resteer:
    """A rewind the watchdog asks for: ``seq`` back to ``position`` tokens (prompt included), its
    text to ``text``, then on with ``repetition_penalty``."""

    seq: Sequence
    position: int
    text: str
    repetition_penalty: float


class LoopWatchdog:
    """Looks at the sequences that got tokens and asks for re-steers; it changes nothing itself."""

    def __init__(self, boundaries: BoundaryTokens, config: WatchdogConfig | None = None):
        self.boundaries = boundaries
        self.config = config or WatchdogConfig()
        self.counts: dict[str, int] = {}

    def check(self, seqs: Iterable[Sequence]) -> list[Resteer]:
        """The re-steers to carry out for the sequences that got a token this step."""
        out = []
        for seq in seqs:
            if seq.finished or not self.boundaries.applies_to(seq):
                continue
            start = loop_start(seq.output_token_ids, self.config)
            if start is not None and (resteer := self._resteer(seq, start)) is not None:
                out.append(resteer)
        return out

    def count(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1

    def _resteer(self, seq: Sequence, start: int) -> Resteer | None:
        outputs = seq.output_token_ids
        keep = next((i + 1 for i in range(start - 1, -1, -1) if outputs[i] in self.boundaries.ids), 0)
        if seq.num_rollbacks >= self.config.max_rollbacks:
            return self.count("declined_cap")
        kept_text = self.boundaries.tokenizer.decode(outputs[:keep], skip_special_tokens=seq.params.skip_special_tokens)
        if seq.num_text_sent > len(kept_text):
            return self.count("declined_streamed")
        penalty = max(seq.params.repetition_penalty, 1.0) * self.config.penalty_factor
        return Resteer(seq, len(seq.prompt_token_ids) + keep, kept_text, penalty)

    def declined(self, resteer: Resteer, exc: LayerStateNotRewindable) -> None:
        log.warning("loop watchdog cannot re-steer request %s: %s", resteer.seq.request_id, exc)
        self.count("declined_not_rewindable")

    def resteered(self, resteer: Resteer) -> None:
        self.count("resteered")
        log.info("loop watchdog re-steered request %s to output token %d (repetition_penalty %.2f)",
                 resteer.seq.request_id, resteer.position - len(resteer.seq.prompt_token_ids), resteer.repetition_penalty)
