"""Sampling parameters (shaped like vLLM's) and the batched sampler that turns logits into tokens.

The sampler works on a whole batch at once: every per-row knob (penalties, temperature, top-k,
top-p, min-p) becomes a ``[B]`` tensor and is applied with tensor ops over ``[B, V]``. The only
per-row Python loop draws the random noise of seeded rows, so that a seeded request samples the
same tokens whatever else is in the batch and whichever row it sits in.

Order of operations, as in vLLM:

0. structured outputs: the model runner sets every token a request's grammar forbids to the
   lowest finite logit (`apply_token_bitmask`, one call for all constrained rows of the step,
   verify rows included) before anything below, logprobs included (vLLM masks before them too);
1. logprobs (when asked for) are taken from the RAW logits: ``log_softmax`` of the model's
   logits, before penalties, temperature and filters (vLLM's default ``raw_logprobs`` mode);
2. ``logit_bias`` (OpenAI's: a number in [-100, 100] added to a token's logit), then
   repetition penalty (prompt and output tokens), then frequency and presence penalties
   (output tokens only);
3. ``min_tokens``: EOS and stop token ids are set to -inf until enough tokens were generated;
4. greedy rows (``temperature == 0``) take the argmax of the penalised logits;
5. sampled rows: temperature → min-p → top-k → top-p (over the mass that survived top-k,
   renormalised) → one draw with the exponential race ``argmax(probs / q)``, ``q ~ Exp(1)``.

``target_probs`` returns the distribution of that draw (one-hot for greedy rows) without drawing:
speculative verification accepts or rejects drafts against it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import attrs
import torch

from layerzoo.errors import UserError
from layerzoo.structured_outputs import StructuredOutputsParams, TokenBitmask, unknown_fields

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
    # layerzoo.structured_outputs).
    structured_outputs: StructuredOutputsParams | None = attrs.field(
        default=None,
        converter=_structured,
        validator=_check(lambda v: v is None or isinstance(v, StructuredOutputsParams), "a StructuredOutputsParams, a dict of its fields or None"),
    )
    # vLLM's thinking budget: after this many generated tokens inside an open reasoning block the
    # chat format's end marker (</think>) is forced, then the answer follows (layerzoo.thinking_budget)
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


# -- the sampler --------------------------------------------------------------------------------


class NonFiniteLogitsError(UserError):
    """The model produced NaN or infinite logits: no token can be sampled from them.

    Usually broken weights (NaN in the checkpoint) or an overflow in a low-precision dtype. A
    `UserError` because it is the checkpoint's or the settings' fault, not the request's text.
    """

    def __init__(self, rows: list[int], batch: int, request_ids: list[str] | None = None):
        self.rows, self.batch, self.request_ids = rows, batch, request_ids
        which = f"request(s) {', '.join(request_ids)}" if request_ids else f"row(s) {rows}"
        super().__init__(
            f"the model produced non-finite logits (NaN or inf) for {len(rows)} of {batch} sequence(s) in the batch "
            f"({which}); check the checkpoint's weights for NaN/inf, or run in float32 (dtype='float32')"
        )

    def for_requests(self, request_ids: list[str]) -> "NonFiniteLogitsError":
        """The same error naming the requests of the bad rows (the engine knows them, the sampler does not)."""
        return NonFiniteLogitsError(self.rows, self.batch, list(dict.fromkeys(request_ids)))


def check_finite(logits: torch.Tensor) -> None:
    """Raise `NonFiniteLogitsError` naming the rows of ``logits [B, V]`` holding NaN or inf."""
    if math.isfinite(float(logits.sum(dtype=torch.float64))):
        # Any NaN or inf makes the sum NaN or inf; finite fp32 logits cannot overflow a float64
        # sum. One pass without a [B, V] mask: the exact check cost ~0.2 ms a step at V = 152k.
        return
    finite = torch.isfinite(logits).all(dim=-1)  # [B]
    if not bool(finite.all()):
        raise NonFiniteLogitsError((~finite).nonzero().flatten().tolist(), logits.shape[0])


@attrs.frozen
class SamplingRow:
    """What the sampler needs to know about one row of the batch.

    ``generator`` is the request's own RNG (seeded requests; any device) or None for the global
    RNG. ``eos_token_ids`` are masked together with ``params.stop_token_ids`` while fewer than
    ``params.min_tokens`` tokens were generated; the engine passes the tokenizer's EOS ids unless
    ``ignore_eos``.
    """

    params: SamplingParams
    generator: torch.Generator | None
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]
    eos_token_ids: Sequence[int] = ()


@attrs.frozen
class SamplerOutput:
    """One sampled token per row, with logprobs of the RAW distribution where asked for.

    ``logprobs[b]`` is the chosen token's logprob and ``top_logprobs[b]`` the top-n ``(id, logprob)``
    pairs, descending (``[]`` for ``logprobs=0``); both are None for rows with ``params.logprobs=None``.
    """

    token_ids: list[int]  # [B]
    logprobs: list[float | None]  # [B]
    top_logprobs: list[list[tuple[int, float]] | None]  # [B]


def apply_token_bitmask(logits: torch.Tensor, mask: TokenBitmask | None) -> torch.Tensor:
    """Structured outputs' masks on ``logits [R, V]`` in place (rows ``mask.rows``; the others are
    untouched): a forbidden token gets the lowest finite logit, so softmax gives it 0 and no argmax
    picks it. One kernel call for the whole step (`layerzoo.kernels.sampling`)."""
    if mask is not None:
        from layerzoo.ops import kernel

        kernel("apply_token_bitmask")(logits, mask.bits, mask.rows)
    return logits


def _min_tokens_active(row: SamplingRow) -> bool:
    p = row.params
    return len(row.output_token_ids) < p.min_tokens and bool(p.stop_token_ids or row.eos_token_ids)


def _row_tensor(values: list, device: torch.device, dtype=torch.float32) -> torch.Tensor:
    """Per-row parameters ``[B]`` on the logits' device."""
    return torch.tensor(values, dtype=dtype, device=device)


def _bincount_rows(token_lists: Sequence[Sequence[int]], vocab: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row's list: ``[B, V]`` counts from a scatter (bincount) of flat ids."""
    lengths = [len(ids) for ids in token_lists]
    batch = len(token_lists)
    if not any(lengths):
        return torch.zeros(batch, vocab, dtype=torch.long, device=device)
    ids = _row_tensor(list(itertools.chain.from_iterable(token_lists)), device, torch.long)
    rows = torch.repeat_interleave(torch.arange(batch, device=device), _row_tensor(lengths, device, torch.long))
    return torch.bincount(rows * vocab + ids, minlength=batch * vocab).view(batch, vocab)


def apply_penalties(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Repetition, then frequency and presence penalties on ``logits [B, V]`` (a new tensor).

    Rows without penalties get neutral values (1, 0, 0) and come out unchanged.
    """
    batch, vocab = logits.shape
    device = logits.device
    params = [r.params for r in rows]
    # Only rows with penalties contribute token ids: the others would be built for nothing.
    outputs = [r.output_token_ids if r.params.has_penalties else () for r in rows]
    prompts = [r.prompt_token_ids if r.params.repetition_penalty != 1.0 else () for r in rows]
    counts = _bincount_rows(outputs, vocab, device).to(logits.dtype)  # [B, V]
    seen_in_output = counts > 0

    repetition = _row_tensor([p.repetition_penalty for p in params], device, logits.dtype)[:, None]  # [B, 1]
    seen = seen_in_output | (_bincount_rows(prompts, vocab, device) > 0)
    penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalised, logits)

    frequency = _row_tensor([p.frequency_penalty for p in params], device, logits.dtype)[:, None]
    presence = _row_tensor([p.presence_penalty for p in params], device, logits.dtype)[:, None]
    return logits - frequency * counts - presence * seen_in_output.to(logits.dtype)


def apply_logit_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Add each row's ``logit_bias`` to ``logits [B, V]`` (a new tensor): one scatter-add for the
    whole batch. Token ids are checked against the vocabulary when the request is added."""
    row_idx, token_idx, biases = [], [], []
    for b, row in enumerate(rows):
        for token, bias in (row.params.logit_bias or {}).items():
            row_idx.append(b)
            token_idx.append(token)
            biases.append(bias)
    if not row_idx:
        return logits
    device = logits.device
    index = (_row_tensor(row_idx, device, torch.long), _row_tensor(token_idx, device, torch.long))
    return logits.index_put(index, _row_tensor(biases, device, logits.dtype), accumulate=True)


def mask_min_tokens(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Set EOS and stop token ids to -inf ``[B, V]`` in rows that have not reached ``min_tokens``."""
    vocab = logits.shape[-1]
    row_idx, token_idx = [], []
    for b, row in enumerate(rows):
        if _min_tokens_active(row):
            ids = {t for t in itertools.chain(row.params.stop_token_ids, row.eos_token_ids) if 0 <= t < vocab}
            row_idx += [b] * len(ids)
            token_idx += sorted(ids)
    if not row_idx:
        return logits
    logits = logits.clone()
    logits[_row_tensor(row_idx, logits.device, torch.long), _row_tensor(token_idx, logits.device, torch.long)] = float("-inf")
    return logits


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below ``min_p * max_prob``: logits ``[S, V]``, min_p ``[S]``."""
    probs = torch.softmax(logits, dim=-1)
    threshold = min_p[:, None] * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the k highest logits, then the minimal prefix of those whose renormalised mass reaches p.

    logits ``[S, V]``; top_k ``[S]`` long (V = off); top_p ``[S]`` (1 = off). Runs the registered
    ``top_k_top_p`` op (`layerzoo.kernels.sampling`): one sort on CPU, a Triton kernel on CUDA.
    """
    from layerzoo.ops import kernel

    return kernel("top_k_top_p")(logits, top_k, top_p)


def _exponential_noise(generators: Sequence[torch.Generator | None], vocab: int, device: torch.device) -> torch.Tensor:
    """``q ~ Exp(1)`` of shape ``[S, V]``: each seeded row from its own generator, the rest from the global RNG."""
    noise = torch.empty(len(generators), vocab, device=device)
    unseeded = [i for i, g in enumerate(generators) if g is None]
    if len(unseeded) == len(generators):
        return noise.exponential_()
    if unseeded:
        noise[unseeded] = torch.empty(len(unseeded), vocab, device=device).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None:  # one draw of V numbers per step, whatever the batch: reproducible
            noise[i] = torch.empty(vocab, device=gen.device).exponential_(generator=gen).to(device)
    return noise


def _penalise_and_mask(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Steps 2–3 on ``logits [B, V]``: fp32, logit bias and penalties where asked for, then the
    ``min_tokens`` mask."""
    logits = logits.float()
    if any(r.params.logit_bias for r in rows):
        logits = apply_logit_bias(logits, rows)
    if any(r.params.has_penalties for r in rows):
        logits = apply_penalties(logits, rows)
    return mask_min_tokens(logits, rows)


def _sampling_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Step 5 before the draw: logits ``[S, V]`` (penalised, sampled rows) → the probabilities ``[S, V]`` drawn from."""
    device, vocab = logits.device, logits.shape[-1]
    params = [r.params for r in rows]
    logits = logits / _row_tensor([p.temperature for p in params], device)[:, None]
    if any(p.min_p > 0 for p in params):
        logits = apply_min_p(logits, _row_tensor([p.min_p for p in params], device))
    if any(0 < p.top_k < vocab or p.top_p < 1 for p in params):
        top_k = _row_tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device, torch.long)
        logits = apply_top_k_top_p(logits, top_k, _row_tensor([p.top_p for p in params], device))
    return torch.softmax(logits, dim=-1)


def _sample_rows(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """Filter and draw one token per row: logits ``[S, V]`` (penalised) → token ids ``[S]``."""
    probs = _sampling_probs(logits, rows)
    # Exponential race: argmax(p_i / q_i) with q_i ~ Exp(1) picks i with probability p_i. The clamp
    # keeps a (vanishingly rare) q == 0 from turning a filtered 0 / 0 into NaN.
    noise = _exponential_noise([r.generator for r in rows], probs.shape[-1], probs.device)
    noise = noise.clamp_min_(torch.finfo(probs.dtype).tiny)
    return (probs / noise).argmax(dim=-1)


def target_probs(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> torch.Tensor:
    """The distribution the Sampler draws each row's token from: logits ``[R, V]`` → probabilities ``[R, V]`` fp32.

    The same steps in the same order as ``Sampler`` (penalties, ``min_tokens`` mask, temperature,
    min-p, top-k/top-p); a greedy row is one-hot at the Sampler's argmax. For speculative
    verification (``layerzoo.speculative.rejection_sample``) each verify row carries its own
    ``SamplingRow``: row i's ``output_token_ids`` include the drafts before it, so that penalties
    and ``min_tokens`` see what the Sampler would have seen had it produced those tokens itself.
    """
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"expected logits [R, V] with R = {len(rows)} rows, got shape {tuple(logits.shape)}")
    logits = _penalise_and_mask(logits, rows)
    probs = torch.zeros_like(logits)
    probs.scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)  # greedy rows; sampled rows are overwritten
    sampled = [b for b, r in enumerate(rows) if not r.params.greedy]
    if sampled:
        index = torch.tensor(sampled, device=logits.device)
        probs[index] = _sampling_probs(logits[index], [rows[b] for b in sampled])
    return probs


def _logprobs(
    raw_logits: torch.Tensor, tokens: torch.Tensor, rows: Sequence[SamplingRow]
) -> tuple[list[float | None], list[list[tuple[int, float]] | None]]:
    """The chosen token's logprob and the top-n of ``log_softmax(raw_logits)`` ``[B, V]`` for rows that ask."""
    chosen: list[float | None] = [None] * len(rows)
    top: list[list[tuple[int, float]] | None] = [None] * len(rows)
    wanted = [b for b, r in enumerate(rows) if r.params.logprobs is not None]
    if not wanted:
        return chosen, top
    index = torch.tensor(wanted, device=raw_logits.device)
    logprobs = torch.log_softmax(raw_logits[index].float(), dim=-1)  # [W, V]
    own = logprobs.gather(-1, tokens[index][:, None]).squeeze(-1).tolist()
    n_max = max(rows[b].params.logprobs for b in wanted)
    top_values, top_ids = (t.tolist() for t in torch.topk(logprobs, n_max, dim=-1))  # [W, n_max], descending
    for w, b in enumerate(wanted):
        n = rows[b].params.logprobs
        chosen[b] = own[w]
        top[b] = list(zip(top_ids[w][:n], top_values[w][:n]))
    return chosen, top


def prompt_logprob_entries(raw_logits: torch.Tensor, targets: Sequence[int], k: int) -> list[dict[int, float]]:
    """Prompt logprobs of ``raw_logits [R, V]`` (row r predicts ``targets[r]``): per row the
    ``{token_id: logprob}`` of the top-``k`` of ``log_softmax`` and the target token, shaped like a
    generation logprobs entry (`OutputProcessor.record_logprobs`)."""
    logprobs = torch.log_softmax(raw_logits.float(), dim=-1)  # [R, V]
    index = torch.tensor(list(targets), dtype=torch.long, device=logprobs.device)[:, None]
    own = logprobs.gather(-1, index).squeeze(-1).tolist()
    if k:
        top_values, top_ids = (t.tolist() for t in torch.topk(logprobs, k, dim=-1))  # descending
    else:
        top_values = top_ids = [[]] * len(own)
    entries = []
    for target, lp, ids, values in zip(targets, own, top_ids, top_values):
        entry = dict(zip(ids, values))
        entry[target] = lp
        entries.append(entry)
    return entries


class Sampler:
    """Turns a batch of logits into one token per row, each row with its own ``SamplingParams``."""

    def __init__(self):
        from layerzoo.ops import kernel

        # argmax and the NaN/inf screen in one pass (the C++ kernel on CPU): ~10 us against ~130 us
        # for a float64 sum then aten's argmax at V = 152k, in every greedy decode step
        self._argmax_finite = kernel("argmax_finite")

    def __call__(self, logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
        """logits ``[B, V]`` fp32 → one token per row (see the module docstring for the order of steps)."""
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(f"expected logits [B, V] with B = {len(rows)} rows, got shape {tuple(logits.shape)}")
        if self.argmax_only(rows):
            return self._output(self.greedy(logits))
        check_finite(logits)

        raw_logits = logits
        logits = _penalise_and_mask(logits, rows)
        tokens = logits.argmax(dim=-1)  # right for greedy rows; sampled rows are overwritten below
        sampled = [b for b, r in enumerate(rows) if not r.params.greedy]
        if sampled:
            index = torch.tensor(sampled, device=logits.device)
            tokens[index] = _sample_rows(logits[index], [rows[b] for b in sampled])
        chosen, top = _logprobs(raw_logits, tokens, rows)
        return SamplerOutput(token_ids=tokens.tolist(), logprobs=chosen, top_logprobs=top)

    def greedy(self, logits: torch.Tensor) -> list[int]:
        """Each row's argmax of ``logits [B, V]``; raises `NonFiniteLogitsError` naming rows with NaN or inf."""
        ids = self._argmax_finite(logits).tolist()
        if min(ids) < 0:  # a row holds NaN or inf: the exact check names the rows
            check_finite(logits)
            raise AssertionError("argmax_finite flagged a row that check_finite finds finite")
        return ids

    @staticmethod
    def argmax_only(rows: Sequence[SamplingRow]) -> bool:
        """The fast path: every row greedy, without logit bias, penalties, logprobs or min_tokens masking."""
        return all(
            r.params.greedy and not r.params.has_penalties and r.params.logprobs is None and not r.params.logit_bias
            and not _min_tokens_active(r)
            for r in rows
        )

    @staticmethod
    def _output(token_ids: list[int]) -> SamplerOutput:
        none = [None] * len(token_ids)
        return SamplerOutput(token_ids=token_ids, logprobs=none, top_logprobs=list(none))
