"""The ``"mtp"`` proposer: drafts from the checkpoint's own multi-token-prediction head.

Two halves, because the scheduler is device-free and the runner owns the device:

- `MtpProposer` (here, no torch) is what the scheduler asks, like any proposer. It hands out the
  drafts the runner made for a sequence at the end of the step before, if they follow the
  sequence's tokens as they are now (``[]`` otherwise: a rewind, a preemption).
- `layerzoo.speculative.mtp_drafter.MtpDrafter` (the runner's) runs the head after each step's
  sampling: over the rows the target just ran (each fed the token one past it and the target's
  hidden state there), which writes the head's KV into the paged pool at the same positions, and
  then chained rows from the last kept one, one token each, up to as many drafts as the step
  asked for (at most ``num_speculative_tokens``; `wanted`).

The head runs for a sequence only in a step whose schedule asked for its drafts (drafting, or
the adaptive policy's shadow check) and over every prompt row. A sequence that does not draft
costs no head work: its rows (the target's hidden state and the token after each) wait in the
drafter, and run before its next head rows, when it drafts again. The head's KV at a position
depends only on that row (its block attends, but its keys and values are projections of the row's
own input), so rows caught up late write what they would have written in their own step. At most
`MtpDrafter.PENDING_ROWS` rows wait per sequence; the head's KV at older positions stays unwritten
(drafts only: outputs are verified).

So the head's KV covers what the target's covers, through prefix caching (prompt rows always
run), preemption (recomputed with the prompt), chunked prefill and ``n > 1`` forks (they share
prompt blocks), except positions a sequence generated while not drafting and never caught up;
the chained rows write ``lookahead`` positions past a step's last row, which the scheduler
reserves when blocks are free. Drafts come one step after the ask: a sequence asked after a step
in which the head did not run for it gets no draft that once (`propose_for` answers ``[]``) and
its drafts from the next step on. The adaptive policy's shadow check asks once and collects the
guess a step later (`peek`), and waits up to `SHADOW_MAX_GAP` tokens between guesses that miss: a
guess costs a head step, not a Python scan. It asks a guess of one draft (no chained row); once
that token came true it asks the drafts to verify with and the guess's second token
(`ask_second`): the head's row before the last, which runs in that head step anyway (it waited),
through the whole block and the LM head, guesses the token the step samples.

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

    # The longest wait, in generated tokens, between shadow guesses that keep missing
    # (`layerzoo.speculative.adaptive`): each costs a head step for the sequence, with the rows
    # it skipped since the last one.
    SHADOW_MAX_GAP = 64

    def __init__(self, num_speculative_tokens: int, first_drafts: int | None = None):
        self.num_speculative_tokens = num_speculative_tokens
        # Drafts the head makes for a sequence new to drafting, after its prompt: all k, or fewer
        # where nothing verifies them as they are (`from_config`).
        self.first_drafts = num_speculative_tokens if first_drafts is None else first_drafts
        # Positions past a sampling chunk's last row whose KV the chained head rows write.
        self.lookahead = num_speculative_tokens - 1
        self.shadow_max_gap = self.SHADOW_MAX_GAP
        self.drafts: dict[int, tuple[int, list[int]]] = {}  # seq_id -> (its length they follow, drafts)
        self.asked: dict[int, int] = {}  # seq_id -> most drafts asked for since the runner last drafted
        self.seen: set[int] = set()  # sequences the runner has drafted for (forgotten when freed)
        # seq_id -> the length before which the adaptive policy will not ask for a guess (`rest`):
        # the runner keeps none of its rows until they lead up to that.
        self.resting: dict[int, int] = {}
        self.second_asks: set[int] = set()  # sequences asked for a second token since the runner last drafted (`ask_second`)
        self.second_tokens: dict[int, tuple[int, int]] = {}  # seq_id -> (its length, the head's guess at its last token)

    @classmethod
    def from_config(cls, config: SpeculativeConfig) -> MtpProposer:
        """The registered factory of method ``"mtp"``.

        Under adaptive drafting a new sequence verifies nothing at first (its prior expects no draft
        to pay): the head's drafts after its prompt are only its first shadow guess, which the
        policy scores on one token and the head's second (asked the step before the guess can count,
        as for every later guess), so the head makes one draft there and chains no row. Each chained
        row is a head step: two of them (k = 3) were 0.36 of the prompt's 0.61 ms head work at one
        request of bench/speculative.py's low-acceptance workload."""
        return cls(config.num_speculative_tokens, first_drafts=1 if config.adaptive else None)

    def propose(self, token_ids: Sequence[int], k: int) -> list[int]:
        """No draft without knowing the sequence: the scheduler asks `propose_for`."""
        return []

    def propose_for(self, seq_id: int, token_ids: Sequence[int], k: int) -> list[int]:
        """The drafts made for ``token_ids`` as they are (``[]`` if none); the runner drafts for
        ``seq_id`` after this step, ``k`` of them (its chained rows follow the asks)."""
        self.asked[seq_id] = max(k, self.asked.get(seq_id, 0))
        self.resting.pop(seq_id, None)
        return self.peek(seq_id, token_ids, k)

    def rest(self, seq_id: int, length: int) -> None:
        """The adaptive policy's word that ``seq_id`` is asked for nothing before it holds ``length``
        tokens (a shadow guess waiting after misses, or no guess while none could pay): the runner
        need not keep its rows for the head until they lead up to that (`MtpDrafter.head_rows`)."""
        self.resting[seq_id] = length

    def peek(self, seq_id: int, token_ids: Sequence[int], k: int) -> list[int]:
        """`propose_for` without asking: the head does not run for ``seq_id`` on its account."""
        made = self.drafts.get(seq_id)
        if made is None or made[0] != len(token_ids):
            return []
        return made[1][:k]

    def ask_second(self, seq_id: int) -> None:
        """Ask, beside this step's drafts for ``seq_id``, the head's own guess at the token the step
        samples: its row before the last (fed the token before it, which the head's one-token guess
        got right), run through the whole block and the LM head. The adaptive policy's one-token
        guesses take it for their second token (`second`): a guess costs no chained row."""
        self.second_asks.add(seq_id)

    def second(self, seq_id: int, token_ids: Sequence[int]) -> int | None:
        """The second token asked (`ask_second`) with the drafts for ``token_ids`` as they are: the
        head's guess at their last token (None: none was made for this length)."""
        made = self.second_tokens.get(seq_id)
        return made[1] if made is not None and made[0] == len(token_ids) else None

    def drafts_now(self, seq_id: int) -> bool:
        """Whether the runner runs the head for ``seq_id`` this step: asked for drafts in the
        step's schedule, or new to drafting (its prompt's last row)."""
        return seq_id in self.asked or seq_id not in self.seen

    def wanted(self, seq_id: int) -> int:
        """How many drafts the runner makes for ``seq_id`` this step: as many as the step's schedule
        asked for (the next one asks about as many: adaptive draft lengths change slowly),
        ``first_drafts`` for a sequence new to drafting."""
        return min(self.asked.get(seq_id, self.first_drafts), self.num_speculative_tokens)

    def store(self, seq_id: int, length: int, drafts: list[int]) -> None:
        """The runner's drafts for ``seq_id`` once it holds ``length`` tokens."""
        self.drafts[seq_id] = (length, drafts)
        self.seen.add(seq_id)
        self.second_tokens.pop(seq_id, None)

    def store_second(self, seq_id: int, length: int, token: int) -> None:
        """The runner's second token (`ask_second`) for ``seq_id`` once it holds ``length`` tokens (after its drafts)."""
        self.second_tokens[seq_id] = (length, token)

    def step_done(self) -> None:
        """The runner has drafted for the step: the next schedule's asks start afresh."""
        self.asked.clear()
        self.second_asks.clear()

    def forget(self, seq_id: int) -> None:
        self.drafts.pop(seq_id, None)
        self.seen.discard(seq_id)
        self.asked.pop(seq_id, None)
        self.resting.pop(seq_id, None)
        self.second_asks.discard(seq_id)
        self.second_tokens.pop(seq_id, None)

    def __repr__(self) -> str:
        return f"MtpProposer(num_speculative_tokens={self.num_speculative_tokens}, first_drafts={self.first_drafts})"
