"""Sampling parameters, shaped like vLLM's ``SamplingParams``: what a request asks of the sampler
(`layerzoo.runtime.sampler`), validated when built, with errors naming the field."""

from __future__ import annotations

import math

import attrs

from layerzoo.errors import UserError
from layerzoo.runtime.structured_outputs import StructuredOutputsParams, unknown_fields

# Temperatures below this are treated as greedy (as vLLM does): dividing by them only overflows.
_GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_N = 16
MAX_LOGIT_BIAS = 100.0  # OpenAI's range: -100 bans a token in practice, +100 forces it


# -- parameters ---------------------------------------------------------------------------------


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value) -> bool:
    """A finite int or float (bools are not numbers here)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _check(predicate, expected: str):
    """An attrs validator raising a one-line UserError that names ``SamplingParams.<field>``."""

    def validate(_instance, attribute, value) -> None:
        if not predicate(value):
            raise UserError(f"SamplingParams.{attribute.name}: expected {expected}, got {value!r}")

    return validate


def _structured(value):
    """``structured_outputs``: a `StructuredOutputsParams`, or a dict of its fields, or None."""
    if isinstance(value, dict):
        if (unknown := unknown_fields(value)) is not None:
            raise UserError(f"SamplingParams.structured_outputs: {unknown}")
        return StructuredOutputsParams(**value)
    return value


def _logit_bias(value):
    """``logit_bias``: a dict copied (so the caller's later edits change nothing), ``{}`` → None."""
    if isinstance(value, dict):
        return dict(value) or None
    return value


def _valid_logit_bias(value) -> bool:
    return value is None or (isinstance(value, dict) and all(
        _is_int(t) and t >= 0 and _is_real(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for t, b in value.items()))


def _as_list(value):
    """``None`` → ``[]``, a string → ``[string]``, a list/tuple → a list; anything else is left for the validator."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, (list, tuple)):
        return list(value)
    return value


@attrs.define(kw_only=True)
class SamplingParams:
    """How to sample one request's continuation (vLLM's fields and meanings).

    ``temperature=0`` is greedy; ``top_k=0`` (or -1), ``top_p=1``, ``min_p=0`` switch those filters
    off. ``repetition_penalty`` (HF/vLLM) divides positive / multiplies negative logits of every
    token seen in the prompt or the output; ``presence_penalty`` and ``frequency_penalty`` (OpenAI)
    subtract ``presence * (count > 0) + frequency * count`` over output tokens only. ``logprobs=n``
    returns the sampled token's logprob and the top-n of the raw distribution; ``prompt_logprobs=k``
    does the same for every prompt token after the first (``RequestOutput.prompt_logprobs``). ``seed`` makes a
    request's samples reproducible whatever else is in the batch. Every field is validated on
    construction and on assignment.
    """

    n: int = attrs.field(default=1, validator=_check(lambda v: _is_int(v) and 1 <= v <= MAX_N, f"an int in [1, {MAX_N}]"))
    temperature: float = attrs.field(default=1.0, validator=_check(lambda v: _is_real(v) and v >= 0, "a number >= 0"))
    top_p: float = attrs.field(default=1.0, validator=_check(lambda v: _is_real(v) and 0 < v <= 1, "a number in (0, 1]"))
    top_k: int = attrs.field(default=0, validator=_check(lambda v: _is_int(v) and v >= -1, "an int >= -1 (0 or -1: off)"))
    min_p: float = attrs.field(default=0.0, validator=_check(lambda v: _is_real(v) and 0 <= v <= 1, "a number in [0, 1]"))
    repetition_penalty: float = attrs.field(default=1.0, validator=_check(lambda v: _is_real(v) and v > 0, "a number > 0"))
    presence_penalty: float = attrs.field(
        default=0.0, validator=_check(lambda v: _is_real(v) and -2 <= v <= 2, "a number in [-2, 2]")
    )
    frequency_penalty: float = attrs.field(
        default=0.0, validator=_check(lambda v: _is_real(v) and -2 <= v <= 2, "a number in [-2, 2]")
    )
    seed: int | None = attrs.field(default=None, validator=_check(lambda v: v is None or _is_int(v), "an int or None"))
    stop: list[str] = attrs.field(
        factory=list,
        converter=_as_list,
        validator=_check(
            lambda v: isinstance(v, list) and all(isinstance(s, str) and s for s in v),
            "a non-empty string, a list of non-empty strings or None",
        ),
    )
    stop_token_ids: list[int] = attrs.field(
        factory=list,
        converter=_as_list,
        validator=_check(
            lambda v: isinstance(v, list) and all(_is_int(t) and t >= 0 for t in v), "a list of token ids >= 0 or None"
        ),
    )
    ignore_eos: bool = attrs.field(default=False, validator=_check(lambda v: isinstance(v, bool), "True or False"))
    max_tokens: int | None = attrs.field(
        default=16, validator=_check(lambda v: v is None or (_is_int(v) and v >= 1), "an int >= 1 or None")
    )
    min_tokens: int = attrs.field(default=0, validator=_check(lambda v: _is_int(v) and v >= 0, "an int >= 0"))
    logprobs: int | None = attrs.field(
        default=None,
        validator=_check(lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS), f"an int in [0, {MAX_LOGPROBS}] or None"),
    )
    # vLLM's prompt logprobs: each prompt token's logprob given the ones before it, with the top-k
    prompt_logprobs: int | None = attrs.field(
        default=None,
        validator=_check(lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS), f"an int in [0, {MAX_LOGPROBS}] or None"),
    )
    # OpenAI's logit_bias: {token_id: bias}, each bias added to that token's logit before penalties
    # and sampling (greedy too); logprobs stay those of the raw logits
    logit_bias: dict[int, float] | None = attrs.field(
        default=None,
        converter=_logit_bias,
        validator=_check(_valid_logit_bias, f"a dict of token ids >= 0 to numbers in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], or None"),
    )
    skip_special_tokens: bool = attrs.field(
        default=True, validator=_check(lambda v: isinstance(v, bool), "True or False")
    )
    # Constrain the output to a JSON schema, regex, choice or grammar (vLLM's field; see
    # layerzoo.runtime.structured_outputs).
    structured_outputs: StructuredOutputsParams | None = attrs.field(
        default=None,
        converter=_structured,
        validator=_check(lambda v: v is None or isinstance(v, StructuredOutputsParams), "a StructuredOutputsParams, a dict of its fields or None"),
    )
    # vLLM's thinking budget: after this many generated tokens inside an open reasoning block the
    # chat format's end marker (</think>) is forced, then the answer follows (layerzoo.runtime.thinking_budget)
    thinking_token_budget: int | None = attrs.field(
        default=None, validator=_check(lambda v: v is None or (_is_int(v) and v >= 0), "an int >= 0 or None")
    )
    # Re-steer this request out of a repetition loop (None: the engine's setting).
    loop_watchdog: bool | None = attrs.field(
        default=None, validator=_check(lambda v: v is None or isinstance(v, bool), "True, False or None")
    )

    def __attrs_post_init__(self):
        # The checks that span two fields; per-field validators cannot see both.
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise UserError(
                f"SamplingParams.min_tokens: expected at most max_tokens ({self.max_tokens}), got {self.min_tokens!r}"
            )
        if self.structured_outputs is not None:
            # A constrained output ends with the EOS its grammar allows once the text is complete:
            # masking EOS (min_tokens) or ignoring it would run on past the end of the language.
            if self.ignore_eos:
                raise UserError("SamplingParams.ignore_eos: cannot be True with structured_outputs (the grammar ends the output with EOS)")
            if self.min_tokens:
                raise UserError("SamplingParams.min_tokens: expected 0 with structured_outputs (the grammar decides where the output ends)")
            if self.thinking_token_budget is not None:  # the grammar decides every token, the marker's too
                raise UserError("SamplingParams.thinking_token_budget: cannot be combined with structured_outputs "
                                "(the grammar decides every token, where the reasoning ends too)")

    @property
    def greedy(self) -> bool:
        """Argmax decoding: ``temperature`` is 0 (or below 1e-5, as in vLLM)."""
        return self.temperature < _GREEDY_EPS

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
