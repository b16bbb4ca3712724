"""One request's sequence: its tokens, its sampling state and why it stopped."""

from __future__ import annotations

import enum
import itertools

import torch

from layerzoo.sampling import SamplingParams

_next_id = itertools.count()


class FinishReason(str, enum.Enum):
    STOP = "stop"  # an EOS id, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context length
    ABORT = "abort"


class Sequence:
    """A prompt and what has been generated for it so far."""

    def __init__(self, prompt_token_ids: list[int], params: SamplingParams, request_id: str | None = None, prompt: str | None = None):
        assert prompt_token_ids, "a sequence needs at least one prompt token"
        self.seq_id = next(_next_id)
        self.request_id = request_id if request_id is not None else str(self.seq_id)
        self.prompt = prompt
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.params = params
        self.num_cached = 0  # tokens whose KV is in the cache (the KV cursor)
        self.finish_reason: FinishReason | None = None
        self.stop_reason: str | int | None = None
        self.text = ""
        self.generator: torch.Generator | None = None
        if params.seed is not None:
            self.generator = torch.Generator().manual_seed(params.seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def __len__(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def num_uncached(self) -> int:
        return len(self) - self.num_cached

    def finish(self, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        assert self.finish_reason is None
        self.finish_reason, self.stop_reason = reason, stop_reason
