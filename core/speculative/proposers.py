"""Proposers: what drafts the tokens that the target model then verifies.

A proposer looks at one sequence's tokens (prompt + output so far) and proposes up to k draft
tokens. Proposers are registered by method name through the ``register_proposers`` hook
(``"ngram"`` is built in, from ``layerzoo.plugins.defaults``) and built from a ``SpeculativeConfig`` with
``build_proposer``. Importing this module stays cheap (no torch): the n-gram proposer is plain
Python.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:
    from layerzoo.plugins.manager import PluginRegistry
    from layerzoo.speculative.config import SpeculativeConfig


@runtime_checkable
class Proposer(Protocol):
    """Drafts tokens for speculative decoding.

    ``propose`` is per sequence and stateless: it sees the whole token list every step, so rolling
    back rejected drafts needs nothing from the proposer. A proposer whose drafts are made
    elsewhere per sequence (the MTP head's, made by the runner from the target's hidden states:
    `layerzoo.speculative.mtp`) answers ``propose_for``, which the scheduler asks; one that runs a
    model on the batch overrides ``propose_batch``. A proposer whose drafts come a step after the
    ask may add ``peek(seq_id, token_ids, k)`` (its drafts without asking for more),
    ``shadow_max_gap``, which the adaptive policy's shadow checks then use, ``rest(seq_id,
    length)``, by which the policy says no guess is asked for the sequence before that length, and
    ``ask_second(seq_id)`` with ``second(seq_id, token_ids)``: its own guess, made with the drafts of
    that ask, at the token the step samples (the policy's guesses are then one token, this their
    second). This protocol only grows, with defaults, like the hookspecs.
    """

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` draft tokens following ``token_ids`` (prompt + output); ``[]``: no draft this step."""
        ...

    def propose_batch(self, token_ids: Sequence[Sequence[int]], k: int) -> list[list[int]]:
        """``propose`` for each sequence of a batch, in order (the default loops)."""
        return [self.propose(ids, k) for ids in token_ids]

    def propose_for(self, seq_id: int, token_ids: Sequence[int], k: int) -> list[int]:
        """``propose`` for the sequence ``seq_id``: a proposer that keeps per-sequence drafts (the
        MTP head's, made by the runner) answers from them; the default ignores the id."""
        return self.propose(token_ids, k)


class NgramProposer(Proposer):
    """Prompt lookup: continue the sequence the way it continued after the same n tokens before.

    For n from ``prompt_lookup_max`` down to ``prompt_lookup_min``, the last n tokens are searched
    for earlier in the sequence (prompt + output); the most recent earlier occurrence of the
    longest n that occurs wins, and the k tokens that followed it are proposed; where they run into
    the end of the sequence, the suffix repeats what lies that far back, so the draft goes on
    repeating it. vLLM's proposer takes the earliest occurrence and stops at the end instead.

    Cost: a C-speed count of the last token (none earlier: no draft, ~0.5 us at 40 tokens against
    1.8 us with the scan), else one reversed copy of the sequence and C-speed ``list.index`` scans
    for it; Python work only at positions that hold the last token, at most ``prompt_lookup_max``
    comparisons each. Linear in the sequence length, with a small constant.
    """

    def __init__(self, prompt_lookup_max: int = 3, prompt_lookup_min: int = 1):
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {prompt_lookup_min}, {prompt_lookup_max}"
            )
        self.prompt_lookup_max = prompt_lookup_max
        self.prompt_lookup_min = prompt_lookup_min

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> NgramProposer:
        """The registered factory of method ``"ngram"``."""
        return cls(config.prompt_lookup_max, config.prompt_lookup_min)

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        length = len(token_ids)
        if k <= 0 or length < self.prompt_lookup_min + 1:
            return []
        last = token_ids[-1]
        # Earlier occurrences of the last token (a C-speed count: most shadow guesses on text with
        # nothing to copy end here, before the reversed copy and the scan).
        earlier = token_ids.count(last) - 1
        if earlier <= 0:
            return []
        # In the reversed sequence the suffix is rev[:n]; an earlier occurrence ending at original
        # index e starts at j = length - 1 - e >= 1, and the smallest j is the most recent one.
        rev = token_ids[::-1]
        longest = self.prompt_lookup_max
        best_len, best_j, j = 0, 0, 0
        for _ in range(earlier):
            if best_len >= longest:
                break
            j = rev.index(last, j + 1)
            matched = 1
            while matched < longest and j + matched < length and rev[j + matched] == rev[matched]:
                matched += 1
            if matched > best_len:  # strictly: an equal length found later is less recent
                best_len, best_j = matched, j
        if best_len < self.prompt_lookup_min:
            return []
        start = length - best_j  # the token after the occurrence, in original order
        if best_j >= k:
            return list(token_ids[start : start + k])
        # What followed runs into the end: the text repeats every best_j tokens, so the draft
        # goes on repeating them (a loop, a repeated line) instead of stopping short.
        return [token_ids[start + i % best_j] for i in range(k)]

    def __repr__(self) -> str:
        return f"NgramProposer(prompt_lookup_max={self.prompt_lookup_max}, prompt_lookup_min={self.prompt_lookup_min})"


def propose_for(proposer, seq_id: int, token_ids: Sequence[int], k: int) -> list[int]:
    """``proposer.propose_for`` where it has one (a proposer written before it existed may not)."""
    method = getattr(proposer, "propose_for", None)
    return method(seq_id, token_ids, k) if method is not None else proposer.propose(token_ids, k)


def build_proposer(config: SpeculativeConfig, registry: PluginRegistry | None = None) -> Proposer:
    """The proposer for ``config.method``, built by the factory a plugin registered for it.

    ``registry`` defaults to the process-wide one; an unknown method is a ``UserError`` listing the
    known methods.
    """
    if registry is None:
        from layerzoo.plugins.manager import get_registry

        registry = get_registry()
    return registry.proposer(config.method)(config)
