"""Acceptance: which draft tokens the target model keeps, and the token it adds after them.

For a sequence with drafts ``d_0 .. d_{k-1}`` the target model runs ``k + 1`` verify rows: row i
holds the target's distribution for the token at draft position i (after the prompt, the output
and ``d_0 .. d_{i-1}``); row k is the bonus row after all k drafts. Every rule emits the accepted
drafts plus one token of the target's own, so a step emits ``num_accepted + 1`` tokens (1..k+1).

* ``greedy_accept``: temperature-0 verification. Keep drafts while they equal the target's argmax.
* ``rejection_sample`` / ``rejection_sample_batch``: speculative sampling (Leviathan et al. 2023,
  Chen et al. 2023). Accept ``d_i`` with probability ``min(1, p_i(d_i) / q_i(d_i))``; at the first
  rejection draw from ``normalize(max(0, p_i - q_i))``; after k acceptances draw the bonus from
  ``p_k``. The emitted tokens are distributed exactly as if drawn one by one from the target.
  ``p`` comes from ``layerzoo.runtime.sampler.target_probs`` (the Sampler's own distribution per row).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_TINY = torch.finfo(torch.float32).tiny


def greedy_accept(draft: Sequence[int], target_argmax: Sequence[int]) -> tuple[int, list[int]]:
    """Keep the longest prefix of ``draft`` that equals ``target_argmax``.

    ``target_argmax`` has ``len(draft) + 1`` entries, the target's greedy token at each verify row
    (a list or a 1-D tensor). Returns ``(num_accepted, tokens)``: the accepted drafts followed by the
    target's token at the first mismatch, or by the bonus token when every draft was accepted.
    """
    if isinstance(target_argmax, torch.Tensor):
        target_argmax = target_argmax.tolist()
    if len(target_argmax) != len(draft) + 1:
        raise ValueError(f"expected {len(draft) + 1} target tokens for {len(draft)} drafts, got {len(target_argmax)}")
    accepted = 0
    while accepted < len(draft) and draft[accepted] == target_argmax[accepted]:
        accepted += 1
    return accepted, [*draft[:accepted], target_argmax[accepted]]


def rejection_sample(
    draft: Sequence[int],
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> tuple[int, list[int]]:
    """Speculative sampling for one sequence.

    :param draft: the k draft tokens (k may be 0: then one token is drawn from ``target_probs[0]``).
    :param target_probs: ``[k + 1, V]``, the target's distribution at each verify row.
    :param draft_probs: ``[k, V]``, the distribution each draft was drawn from; ``None`` for a
        deterministic proposer (n-gram), i.e. ``q_i`` one-hot at ``d_i``: ``d_i`` is then accepted
        with probability ``p_i(d_i)`` and a rejection draws from ``p_i`` without ``d_i``.
    :param generator: the request's RNG, or ``None`` for the global RNG.
    :returns: ``(num_accepted, tokens)`` with ``num_accepted + 1`` tokens.
    """
    k = len(draft)
    drafts = torch.tensor([list(draft)], dtype=torch.long, device=target_probs.device).view(1, k)
    accepted, tokens = rejection_sample_batch(
        drafts, target_probs[None], None if draft_probs is None else draft_probs[None], generator=generator
    )
    num = int(accepted[0])
    return num, tokens[0, : num + 1].tolist()


def rejection_sample_batch(
    drafts: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    draft_lens: torch.Tensor | None = None,
    generator: torch.Generator | Sequence[torch.Generator | None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Speculative sampling for N sequences at once, with tensor ops over the batch.

    :param drafts: ``[N, k]`` long draft tokens (anything past a row's ``draft_lens`` is ignored).
    :param target_probs: ``[N, k + 1, V]``.
    :param draft_probs: ``[N, k, V]``, or ``None`` for deterministic drafts (see ``rejection_sample``).
    :param draft_lens: ``[N]``, how many drafts each row really has (``None``: all k). A row with
        ``n < k`` drafts stops after at most n acceptances and then draws from ``p_n`` as its bonus.
    :param generator: one RNG for the whole batch, one per row (``None`` entries: the global RNG;
        a seeded row then draws the same numbers whatever the batch), or ``None``.
    :returns: ``(num_accepted [N], tokens [N, k + 1])``; row n's emitted tokens are
        ``tokens[n, :num_accepted[n] + 1]``, the rest is -1.
    """
    batch, k = drafts.shape
    vocab = target_probs.shape[-1]
    if target_probs.shape != (batch, k + 1, vocab):
        raise ValueError(f"expected target_probs [{batch}, {k + 1}, V], got {tuple(target_probs.shape)}")
    if draft_probs is not None and draft_probs.shape != (batch, k, vocab):
        raise ValueError(f"expected draft_probs [{batch}, {k}, {vocab}], got {tuple(draft_probs.shape)}")
    device = target_probs.device
    p = target_probs.float()
    drafts = drafts.to(device=device, dtype=torch.long)
    positions = torch.arange(k, device=device)
    lens = torch.full((batch,), k, device=device) if draft_lens is None else draft_lens.to(device)
    valid = positions[None, :] < lens[:, None]  # [N, k]
    safe_drafts = torch.where(valid, drafts, 0)  # padding may hold -1

    # Accept d_i iff u_i < p_i(d_i) / q_i(d_i), written u_i * q_i(d_i) < p_i(d_i) (no 0 / 0; u < 1 so
    # p >= q always accepts). A deterministic draft has q_i(d_i) = 1.
    p_draft = p[:, :k].gather(-1, safe_drafts[..., None]).squeeze(-1)  # [N, k]
    uniform = _draw(generator, batch, k, device, torch.rand)
    if draft_probs is None:
        accept = uniform < p_draft
    else:
        q_draft = draft_probs.float().gather(-1, safe_drafts[..., None]).squeeze(-1)
        accept = uniform * q_draft < p_draft
    accept &= valid
    num_accepted = accept.long().cumprod(dim=-1).sum(dim=-1)  # [N]: the leading run of acceptances

    # The last token: from the residual max(0, p_a - q_a) at a = num_accepted. Past a row's drafts
    # (the bonus row, or a short row) q is 0 and the residual is p_a itself.
    rows = torch.arange(batch, device=device)
    residual = p[rows, num_accepted]  # [N, V] (a copy)
    rejected = num_accepted < lens
    at = num_accepted.clamp_max(max(k - 1, 0))
    if k and draft_probs is None:  # q one-hot: the residual is p_a without the rejected draft
        rejected_draft = safe_drafts[rows, at]
        residual[rows, rejected_draft] = torch.where(rejected, 0.0, residual[rows, rejected_draft])
    elif k:
        residual = torch.where(rejected[:, None], residual - draft_probs.float()[rows, at], residual)
    residual.clamp_min_(0)
    # Rounding can leave a rejection with no residual mass (p ~= q): fall back to p_a itself.
    empty = residual.sum(dim=-1, keepdim=True) <= _TINY
    residual = torch.where(empty, p[rows, num_accepted].clamp_min(0), residual)
    noise = _draw(generator, batch, vocab, device, _exponential).clamp_min_(_TINY)
    last = (residual / noise).argmax(dim=-1)  # the exponential race: picks i with probability ∝ residual_i

    tokens = torch.full((batch, k + 1), -1, dtype=torch.long, device=device)
    tokens[:, :k] = torch.where(positions[None, :] < num_accepted[:, None], drafts, -1)
    tokens[rows, num_accepted] = last
    return num_accepted, tokens


def _exponential(*shape, generator=None, device=None) -> torch.Tensor:
    return torch.empty(*shape, device=device).exponential_(generator=generator)


def _draw(generator, batch: int, width: int, device: torch.device, fn) -> torch.Tensor:
    """``[batch, width]`` random numbers from one RNG, or row by row from per-row RNGs."""
    if generator is None or isinstance(generator, torch.Generator):
        gen_device = device if generator is None else generator.device
        return fn(batch, width, generator=generator, device=gen_device).to(device)
    if len(generator) != batch:
        raise ValueError(f"expected {batch} generators, got {len(generator)}")
    out = torch.empty(batch, width, device=device)
    unseeded = [i for i, g in enumerate(generator) if g is None]
    if unseeded:
        out[unseeded] = fn(len(unseeded), width, device=device)
    for i, gen in enumerate(generator):
        if gen is not None:
            out[i] = fn(width, generator=gen, device=gen.device).to(device)
    return out
