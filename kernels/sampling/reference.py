"""Top-k / top-p (nucleus) filtering in plain torch (the CPU path and the kernels' reference).

The semantics of ``layerzoo.runtime.sampler.apply_top_k_top_p`` with the per-row switches of a sampler
batch: top-k first, then top-p over the probability mass that survived top-k, renormalised.
"""

from __future__ import annotations

import torch


def top_k_top_p_filter(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep each row's k highest logits, then the shortest prefix of those reaching mass p.

    Token ``i`` (in descending order) survives top-p when the renormalised mass of the survivors
    ranked before it is below ``p``, so the most likely token always survives. Filtered logits
    become -inf. Ties at a cut are split by sort position, so exactly k tokens survive top-k.

    Args:
        logits: ``[B, V]`` fp32 (or bf16; the probabilities are fp32 either way).
        top_k: ``[B]`` int64, tokens kept per row; 0 (or anything outside ``[1, V)``) is off.
        top_p: ``[B]`` fp32, mass kept per row in ``(0, 1]``; 1 is off.
    Returns:
        ``[B, V]`` filtered logits in ``logits``' dtype.
    """
    vocab = logits.shape[-1]
    top_k = torch.where((top_k > 0) & (top_k < vocab), top_k, vocab)
    top_p = top_p.float()
    sorted_logits, order = torch.sort(logits.float(), dim=-1, descending=True)  # [B, V]
    position = torch.arange(vocab, device=logits.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(position >= top_k[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # exclusive prefix sum: the first token always stays
    # Rows with top_p == 1 skip the test: rounding can push a prefix sum to 1 before the tail.
    drop = (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits.to(logits.dtype))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """Structured outputs' grammar masks, in place: in row ``rows[g]`` of ``logits``, every token
    whose bit in ``bitmask[g]`` is clear becomes the lowest finite value of the dtype.

    The lowest finite value, not -inf: softmax gives those tokens probability 0 all the same, and
    the greedy path's argmax kernel, which screens rows for NaN/inf in the same pass, still runs.

    Args:
        logits: ``[R, V]`` fp32 (or fp16/bf16), modified in place.
        bitmask: ``[G, W]`` int32 on any device, ``W * 32 >= V``: bit ``t % 32`` of word ``t // 32``
            set means token ``t`` is allowed (llguidance's and xgrammar's layout).
        rows: ``[G]`` int64, the logits row each bitmask row applies to (distinct).
    """
    vocab = logits.shape[-1]
    bitmask = bitmask.to(logits.device, non_blocking=True)
    rows = rows.to(logits.device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=logits.device)
    allowed = ((bitmask[:, :, None] >> shifts) & 1).view(bitmask.shape[0], -1)[:, :vocab].bool()  # [G, V]
    # index_select / index_copy_, not logits[rows] = ...: aten's index_put took 5-50 ms for 8 x 2048
    # on two contended cores (its parallel path), these ~0.2 ms
    masked = logits.index_select(0, rows).masked_fill_(~allowed, torch.finfo(logits.dtype).min)
    logits.index_copy_(0, rows, masked)
