"""The ``"mtp"`` proposer: drafts from the checkpoint's own multi-token-prediction head.

Two halves, because the scheduler is device-free and the runner owns the device:

- `MtpProposer` (here, no torch) is what the scheduler asks, like any proposer. It hands out the
  drafts the runner made for a sequence at the end of the step before, if they follow the
  sequence's tokens as they are now (``[]`` otherwise: a rewind, a preemption).
- `layerzoo.speculative.mtp_drafter.MtpDrafter` (the runner's) runs the head after each step's
  sampling: over the rows the target just ran (each fed the token one past it and the target's
  hidden state there), which writes the head's KV into the paged pool at the same positions, and
  then chained ``num_speculative_tokens - 1`` more rows from the last kept one, one token each.

So the head's KV always covers what the target's covers, through prefix caching, preemption
(recomputed with the prompt), chunked prefill and ``n > 1`` forks; the chained rows write
``lookahead`` positions past a step's last row, which the scheduler reserves when blocks are free.
The chained rows are the head's cost beyond keeping its KV: they run only for sequences the
scheduler asked for drafts in the step (drafting, or the adaptive policy's shadow check) and for
sequences new to drafting. A sequence asked after a step without them gets no draft that once
(`propose_for` answers ``[]``) and its full drafts from the next step on: a sequence the adaptive
policy keeps from drafting costs one head row per step, not k.

One approximation, which changes drafts only, never outputs: the head's row at a cached block's
last position was fed the token after it in the sequence that computed the block, and a sequence
matching the block may continue differently.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from layerzoo.speculative.proposers import Proposer

if TYPE_CHECKING:
    from layerzoo.speculative.config import SpeculativeConfig


class MtpProposer(Proposer):
    """The drafts the MTP head made for each sequence, keyed by sequence id (filled by the runner)."""

    def __init__(self, num_speculative_tokens: int):
        self.num_speculative_tokens = num_speculative_tokens
        # Positions past a sampling chunk's last row whose KV the chained head rows write.
        self.lookahead = num_speculative_tokens - 1
        self.drafts: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (its length they follow, drafts)
        self.asked: set[int] = set()  # sequences asked for drafts since the runner last drafted
        self.seen: set[int] = set()  # sequences the runner has drafted for (forgotten when freed)
        self.unchained: set[int] = set()  # sequences whose stored draft is the head row's alone

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> MtpProposer:
        """The registered factory of method ``"mtp"``."""
        return cls(config.num_speculative_tokens)

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """No draft without knowing the sequence: the scheduler asks `propose_for`."""
        return []

    def propose_for(self, seq_id: int, token_ids: Sequence[int], k: int) -> list[int]:
        self.asked.add(seq_id)
        made = self.drafts.get(seq_id)
        if made is None or made[0] != len(token_ids) or seq_id in self.unchained:
            return []
        return made[1][:k]

    def chains(self, seq_id: int) -> bool:
        """Whether the runner should chain the head for ``seq_id`` this step (see the module docstring)."""
        return seq_id in self.asked or seq_id not in self.seen

    def store(self, seq_id: int, length: int, drafts: list[int], chained: bool = True) -> None:
        """The runner's drafts for ``seq_id`` once it holds ``length`` tokens (``chained`` False: only
        the head row's own draft, no chained rows)."""
        self.drafts[seq_id] = (length, drafts)
        self.seen.add(seq_id)
        if chained:
            self.unchained.discard(seq_id)
        else:
            self.unchained.add(seq_id)

    def step_done(self) -> None:
        """The runner has drafted for the step: the next schedule's asks start afresh."""
        self.asked.clear()

    def forget(self, seq_id: int) -> None:
        self.drafts.pop(seq_id, None)
        self.seen.discard(seq_id)
        self.asked.discard(seq_id)
        self.unchained.discard(seq_id)

    def __repr__(self) -> str:
        return f"MtpProposer(num_speculative_tokens={self.num_speculative_tokens})"
