"""Sampling parameters (shaped like vLLM's) and the sampler that turns logits into tokens."""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import torch

from layerzoo.errors import UserError


def _check(condition: bool, field: str, expected: str, value) -> None:
    if not condition:
        raise UserError(f"SamplingParams.{field}: expected {expected}, got {value!r}")


@attrs.define(kw_only=True)
class SamplingParams:
    """How to sample one request's continuation.

    ``temperature=0`` is greedy. ``top_k=0`` (or -1) and ``top_p=1`` switch those filters off.
    ``seed`` makes a request's samples reproducible whatever else is in the batch.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    max_tokens: int | None = 16
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    n: int = 1

    def __attrs_post_init__(self):
        _check(self.temperature >= 0, "temperature", "a number >= 0", self.temperature)
        _check(0 < self.top_p <= 1, "top_p", "a number in (0, 1]", self.top_p)
        _check(isinstance(self.top_k, int) and self.top_k >= -1, "top_k", "an int >= -1", self.top_k)
        _check(0 <= self.min_p <= 1, "min_p", "a number in [0, 1]", self.min_p)
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", "an int >= 1 or None", self.max_tokens)
        _check(self.n == 1, "n", "1 (n > 1 comes with the paged runtime)", self.n)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled logits ``[V]`` with the top-k / top-p / min-p filtered tokens at -inf."""
    logits = logits / params.temperature
    if params.top_k > 0 and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.min_p > 0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    if params.top_p < 1:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = torch.softmax(sorted_logits, dim=-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (the first token always stays).
        drop = cumulative - torch.softmax(sorted_logits, dim=-1) >= params.top_p
        logits = logits.scatter(0, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token per row of ``logits [B, V]`` (fp32), each row with its own params and generator."""
    tokens = logits.argmax(dim=-1).tolist()
    for row, (p, gen) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        probs = torch.softmax(_filter(logits[row], p), dim=-1)
        tokens[row] = int(torch.multinomial(probs, 1, generator=gen))
    return tokens
