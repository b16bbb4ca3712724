"""The batched sampler that turns logits into tokens, as each row's `SamplingParams` ask.

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
from layerzoo.runtime.structured_outputs import TokenBitmask
from layerzoo.sampling import SamplingParams


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
        from layerzoo.plugins.ops import kernel

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
    from layerzoo.plugins.ops import kernel

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
        from layerzoo.plugins.ops import kernel

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
