"""Thinking budgets: a request's reasoning closed after N generated tokens by forcing the marker.

``SamplingParams(thinking_token_budget=N)`` (vLLM's field; the server's ``thinking_token_budget``
and Anthropic's ``thinking.budget_tokens`` set it): once a sequence has generated N tokens inside
an open reasoning block — opened by the prompt (a template that ends in ``<think>``) or written by
the model — without closing it, its next tokens are forced to be the chat format's end-of-reasoning
marker (``</think>``: one special token for Qwen3, GLM-5 and Kimi, several for a small BPE
vocabulary), after which the model goes on with its answer. SGLang's and vLLM's thinking-budget
processors do the same. The markers are the model's chat format's (`layerzoo.tokenization.chat_formats`,
registered by its plugin), as token ids.

Forcing is a one-token mask on the logits row, applied with the grammar masks' kernel
(`layerzoo.runtime.sampler.apply_token_bitmask`), so greedy, sampled and speculative rows all see only the
forced token: a draft that differs from it is rejected like any other mismatch, and the verify row
then yields the forced token. A verify's row ``i`` is judged after the first ``i`` drafts.

A sequence's budget state (`BudgetState`) is a function of its prompt's opening and its output
tokens: it is advanced over new tokens and recomputed from the start when the output was cut (a
stop string, a watchdog rollback), so preemption and rollback cannot put it out of step.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import attrs
import torch

from layerzoo.errors import UserError
from layerzoo.runtime.structured_outputs import TokenBitmask


@attrs.frozen
class BudgetState:
    """Where one sequence stands after some tokens: ``thinking`` (inside an open reasoning block),
    ``count`` (tokens generated in it so far), ``forcing`` (end-marker tokens forced so far, or -1
    when not forcing) and ``tail`` (the last tokens, to see a multi-token marker complete)."""

    thinking: bool
    count: int = 0
    forcing: int = -1
    tail: tuple[int, ...] = ()


class ThinkingBudgets:
    """The model runner's budget work: per sequence a `BudgetState`, per step the forced rows.

    ``start_ids`` / ``end_ids``: the reasoning markers as token ids; ``vocab_size``: the logits width.
    """

    def __init__(self, start_ids: Sequence[int], end_ids: Sequence[int], vocab_size: int):
        if not start_ids or not end_ids:
            raise ValueError("a thinking budget needs both reasoning markers as token ids")
        self.start_ids, self.end_ids = tuple(start_ids), tuple(end_ids)
        self.vocab_size = vocab_size
        self._keep = max(len(self.start_ids), len(self.end_ids))
        # Keyed by the Sequence object: (output tokens consumed, state after them).
        self._states: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @classmethod
    def for_model(cls, tokenizer, chat_format, vocab_size: int) -> ThinkingBudgets | None:
        """The budgets of a model whose chat format has reasoning markers, or None."""
        markers = getattr(chat_format, "reasoning", None)
        if not markers or tokenizer is None or getattr(tokenizer, "backend", None) is None:
            return None
        start, end = (tokenizer.encode(m, add_special_tokens=False) for m in markers)
        return cls(start, end, vocab_size) if start and end else None

    # -- one sequence ------------------------------------------------------------------------

    def opening(self, prompt_token_ids: Sequence[int]) -> bool:
        """Whether the prompt leaves a reasoning block open: the last marker in it is a start
        marker (as vLLM decides). Scans back from the end, where a template puts the marker."""
        ids = prompt_token_ids
        for i in range(len(ids) - 1, -1, -1):
            for marker, opens in ((self.start_ids, True), (self.end_ids, False)):
                if ids[i] == marker[0] and tuple(ids[i:i + len(marker)]) == marker:
                    return opens
        return False

    def initial(self, seq) -> BudgetState:
        thinking = self.opening(seq.prompt_token_ids)
        return self._check_budget(BudgetState(thinking=thinking), seq.params.thinking_token_budget)

    def step(self, state: BudgetState, token: int, budget: int) -> BudgetState:
        """The state after one more token."""
        tail = (state.tail + (token,))[-self._keep:]
        if state.forcing >= 0:  # this token is the forced marker's next one
            done = state.forcing + 1 == len(self.end_ids)
            return BudgetState(thinking=not done, count=0 if done else state.count,
                               forcing=-1 if done else state.forcing + 1, tail=tail)
        if state.thinking and tail[-len(self.end_ids):] == self.end_ids:
            return BudgetState(thinking=False, tail=tail)
        if tail[-len(self.start_ids):] == self.start_ids:
            state = BudgetState(thinking=True, tail=tail)
        else:
            state = BudgetState(thinking=state.thinking, count=state.count + state.thinking, tail=tail)
        return self._check_budget(state, budget)

    @staticmethod
    def _check_budget(state: BudgetState, budget: int) -> BudgetState:
        if state.thinking and state.forcing < 0 and state.count >= budget:
            return attrs.evolve(state, forcing=0)
        return state

    def forced(self, state: BudgetState) -> int | None:
        """The token the next row must take, or None."""
        return self.end_ids[state.forcing] if state.forcing >= 0 else None

    def state(self, seq) -> BudgetState:
        """``seq``'s state after its output tokens (advanced from the last call's, or recomputed
        from the prompt when the output no longer extends what was consumed)."""
        output, budget = seq.output_token_ids, seq.params.thinking_token_budget
        consumed, state, last = self._states.get(seq, (0, None, None))
        if state is None or consumed > len(output) or (consumed and output[consumed - 1] != last):
            consumed, state = 0, self.initial(seq)
        for token in output[consumed:]:
            state = self.step(state, token, budget)
        if output:
            self._states[seq] = (len(output), state, output[-1])
        else:
            self._states[seq] = (0, state, None)
        return state

    # -- a step ------------------------------------------------------------------------------

    def bitmask(self, chunks) -> TokenBitmask | None:
        """One-token masks for the logits rows of a step's sampling ``chunks`` (in logits order: a
        plain chunk one row, a verify ``1 + len(draft)``) that must take a marker token, or None."""
        rows, tokens, row = [], [], 0
        for chunk in chunks:
            n = 1 + len(chunk.draft)
            budget = chunk.seq.params.thinking_token_budget
            if budget is not None:
                state = self.state(chunk.seq)
                for i in range(n):
                    token = self.forced(state)
                    if token is not None:
                        rows.append(row + i)
                        tokens.append(token)
                    if i < len(chunk.draft):
                        state = self.step(state, chunk.draft[i], budget)
            row += n
        if not rows:
            return None
        return TokenBitmask(torch.tensor(rows, dtype=torch.long), one_token_bits(tokens, self.vocab_size))


def one_token_bits(tokens: Sequence[int], vocab_size: int) -> torch.Tensor:
    """``[G, ceil(V / 32)]`` int32 bitmask rows, row g allowing token ``tokens[g]`` alone."""
    bits = torch.zeros(len(tokens), (vocab_size + 31) // 32, dtype=torch.int32)
    for g, token in enumerate(tokens):
        bit = 1 << (token % 32)
        bits[g, token // 32] = bit - (1 << 32) if bit >= 1 << 31 else bit  # bit 31 is int32's sign
    return bits


def check_budget_request(params, budgets: ThinkingBudgets | None, architecture: str) -> None:
    """Refuse a ``thinking_token_budget`` the model cannot act on (no reasoning markers)."""
    if params.thinking_token_budget is not None and budgets is None:
        raise UserError(f"SamplingParams.thinking_token_budget: {architecture} has no chat format with reasoning "
                        f"markers (its plugin registers none, or its format has no reasoning), so a thinking "
                        f"budget cannot be enforced")
