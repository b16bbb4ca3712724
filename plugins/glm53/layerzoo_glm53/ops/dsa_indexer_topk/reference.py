"""DSA lightning-indexer scoring and causal top-k, plain torch (the CPU path and the reference).

For a query row at absolute position ``p`` and a key at position ``j``::

    score[j] = Σ_h  w[h] · relu(scale · q[h] · key[j])     (fp32)    if j <= p,  else -inf

and the row selects the ``top_k`` keys of highest score. With ``top_k >= p + 1`` every visible key
is selected (the rest of the picks are invisible keys at -inf, which attention masks anyway): the
same set as transformers' ``topk(min(index_topk, T))`` over a causally masked score row.
"""

from __future__ import annotations

import torch


def dsa_indexer_scores(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, q_positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """``[B, n, L]`` fp32 index scores, ``-inf`` at the keys a row cannot see (arguments as
    `dsa_indexer_topk`)."""
    scores = torch.relu(torch.matmul(q.float(), keys.float().transpose(-1, -2).unsqueeze(1)) * scale)  # [B, n, H, L]
    index = torch.matmul(weights.float().unsqueeze(-2), scores).squeeze(-2)  # [B, n, L]
    positions = torch.arange(keys.shape[1], device=keys.device)
    return index.masked_fill(positions[None, None, :] > q_positions[:, :, None], float("-inf"))


def dsa_indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    q_positions: torch.Tensor,
    top_k: int,
    scale: float,
) -> torch.Tensor:
    """The selected key positions of every query row.

    Args:
        q: ``[B, n, H, D]`` indexer queries (rotated).
        weights: ``[B, n, H]`` fp32 head weights (``weights_proj(x) · H^-0.5``).
        keys: ``[B, L, D]`` indexer keys of positions ``0..L-1`` (rotated, normed).
        q_positions: ``[B, n]`` int64 absolute position of each query row; key ``j`` is visible
            to a row at ``p`` iff ``j <= p`` (padding keys past a sequence's length are therefore
            never visible).
        top_k: ``1 <= top_k <= L``.
        scale: the score scale (``D^-0.5``), applied before the ReLU as transformers does.

    Returns:
        ``[B, n, top_k]`` int64 key positions, in descending score order.
    """
    assert 1 <= top_k <= keys.shape[1], (top_k, keys.shape)
    return dsa_indexer_scores(q, weights, keys, q_positions, scale).topk(top_k, dim=-1).indices
