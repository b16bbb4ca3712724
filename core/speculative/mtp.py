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

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> MtpProposer:
        """The registered factory of method ``"mtp"``."""
        return cls(config.num_speculative_tokens)

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """No draft without knowing the sequence: the scheduler asks `propose_for`."""
        return []

    def propose_for(self, seq_id: int, token_ids: Sequence[int], k: int) -> list[int]:
        made = self.drafts.get(seq_id)
        if made is None or made[0] != len(token_ids):
            return []
        return made[1][:k]

    def store(self, seq_id: int, length: int, drafts: list[int]) -> None:
        """The runner's drafts for ``seq_id`` once it holds ``length`` tokens."""
        self.drafts[seq_id] = (length, drafts)

    def forget(self, seq_id: int) -> None:
        self.drafts.pop(seq_id, None)

    def __repr__(self) -> str:
        return f"MtpProposer(num_speculative_tokens={self.num_speculative_tokens})"
