"""One request's sequence: its tokens, its KV cursor, its sampling state and why it stopped."""

from __future__ import annotations

import enum
import itertools
import time

import attrs
import torch

from layerzoo.runtime.pooling import PooledState, PoolingParams
from layerzoo.sampling import SamplingParams

_next_id = itertools.count()


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS id, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"
    POOLED = "pooled"  # a pooling (embedding) request's prompt has run: its vector is ready


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@attrs.define
class Timings:
    """Per-request timestamps (``time.monotonic`` seconds)."""

    arrival: float = attrs.field(factory=time.monotonic)
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None

    def summary(self) -> dict[str, float | None]:
        def since(t):
            return None if t is None else t - self.arrival

        return {
            "queue_s": since(self.first_scheduled),
            "time_to_first_token_s": since(self.first_token),
            "total_s": since(self.finished),
        }


class Sequence:
    """A prompt and what has been generated for it so far.

    ``num_cached`` is the KV cursor: how many leading tokens have K/V in the cache. A running
    sequence with one uncached token decodes; with more it is (re)filling its prompt.
    """

    def __init__(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        prompt: str | None = None,
        *,
        index: int = 0,
        parent: Sequence | None = None,
        pooling: PoolingParams | None = None,
    ):
        assert prompt_token_ids, "a sequence needs at least one prompt token"
        self.seq_id = next(_next_id)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.index = index  # which of the request's n completions
        self.parent = parent  # n > 1: the sibling whose prompt blocks this one shares
        self.status = Status.WAITING
        self.num_cached = 0
        self.num_preemptions = 0
        self.num_rollbacks = 0
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.text = ""
        self.num_text_sent = 0  # characters already streamed to the caller
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        # vLLM's prompt_logprobs, one entry per prompt token (None: nothing predicts the first),
        # filled as prompt chunks run; the request's first completion carries them (n > 1).
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None and parent is None else None
        )
        # A pooling request (embeddings): its prompt runs as a prefill only, its rows pooled here.
        self.pooled: PooledState | None = PooledState(pooling) if pooling is not None else None
        self.timings = Timings()
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            # Each of the n completions draws from its own stream, the same in any batch.
            self.generator = torch.Generator().manual_seed(hash((params.seed, index)) & (2**63 - 1))

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, position: int) -> int:
        """The token at ``position`` (prompt, then output), without building the whole list."""
        prompt_len = len(self.prompt_token_ids)
        return self.prompt_token_ids[position] if position < prompt_len else self.output_token_ids[position - prompt_len]

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def __repr__(self) -> str:
        return f"Sequence(id={self.seq_id}, len={len(self)}, cached={self.num_cached}, {self.status.name})"

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncached(self) -> int:
        return len(self) - self.num_cached

    @property
    def prompt_logprobs_pending(self) -> bool:
        """Prompt logprobs asked for and not all computed yet: the prompt runs whole, uncached."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    @property
    def pools(self) -> bool:
        """A pooling request: prefill only, never sampled; it ends once its prompt has run."""
        return self.pooled is not None

    @property
    def pools_every_row(self) -> bool:
        """Mean pooling: the prompt runs whole, uncached (a prefix hit would skip rows it must add)."""
        return self.pooled is not None and self.pooled.params.method == "mean"

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        assert self.finish_reason is None
        self.finish_reason, self.stop_reason = reason, stop_reason
        self.status = Status.FINISHED
        self.timings.finished = time.monotonic()
