"""MoE routers in plain torch (the CPU path and the kernels' reference): router logits → the top-k
experts of every token and their mixing weights. All routing math is fp32.
"""

from __future__ import annotations

import torch


def softmax_topk(logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over the experts, the k most probable, optionally renormalised over those k.

    Args:
        logits: ``[T, E]`` router logits, any float dtype.
        top_k: experts per token, ``1 <= top_k <= E``.
        renormalize: divide the k chosen probabilities by their sum (``norm_topk_prob``).
    Returns:
        ``(weights [T, k] fp32, ids [T, k] int64)``, by descending probability.
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def sigmoid_grouped_topk(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 router: sigmoid scores, biased grouped selection, unbiased weights.

    The bias (``e_score_correction_bias``) only decides which experts are chosen. Experts form
    ``n_group`` equal groups; a group scores the sum of its two best biased scores (its best one
    when groups hold a single expert); the ``topk_group`` best groups are kept and the ``top_k``
    best biased scores among their experts are chosen. The weights are the chosen experts'
    sigmoid scores, divided by their sum (+1e-20) if ``renormalize``, times ``routed_scaling_factor``.

    Args:
        logits: ``[T, E]`` router logits, any float dtype.
        bias: ``[E]`` selection bias.
        top_k: experts per token, at most ``topk_group * E / n_group``.
        n_group: number of expert groups, dividing ``E`` (1: no grouping).
        topk_group: groups kept per token, ``1 <= topk_group <= n_group``.
    Returns:
        ``(weights [T, k] fp32, ids [T, k] int64)``, by descending biased score.
    """
    num_tokens, num_experts = logits.shape
    scores = torch.sigmoid(logits.float())
    choice = scores + bias.float()
    if n_group > 1:
        grouped = choice.view(num_tokens, n_group, num_experts // n_group)
        group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)  # [T, G]
        kept = torch.topk(group_scores, topk_group, dim=-1).indices
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, kept, True)  # [T, G]
        # -inf, not 0.0 as some ports write: a kept expert may have a negative biased score.
        choice = grouped.masked_fill(~keep[:, :, None], float("-inf")).view(num_tokens, num_experts)
    ids = torch.topk(choice, top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids
