"""mHC (manifold-constrained hyper-connections) mixing weights and the stream collapse, plain torch.

A layer's ``N`` residual streams ``X [T, N, D]`` give, through one learned projection (``mixes``,
the caller's matmul of the RMS-normed flattened streams with ``fn``), three sets of weights per
token (GLM-5.3-Flash, transformers' ``Glm5NextTextHyperConnection``)::

    pre  = sigmoid(mix_pre  · scale[0] + base_pre) + eps                      [N]
    post = 2 · sigmoid(mix_post · scale[1] + base_post)                         [N]
    comb = softmax_rows(mix_comb · scale[2] + base_comb) + eps                 [N, N]
    comb ← comb / (column sums + eps), then (iters - 1) × rows then columns    (Sinkhorn-Knopp)

and the sublayer's input is the collapse ``Σ_n pre[n] · X[n]``. The caller then forms
``X' = post ⊗ sublayer(...) + combᵀ X``. All weights are fp32.
"""

from __future__ import annotations

import torch


def mhc_sinkhorn(
    mixes: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    streams: torch.Tensor,
    eps: float,
    iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The mixing weights of every token and its collapsed streams.

    Args:
        mixes: ``[T, (2 + N) N]`` fp32, ``[pre | post | comb]`` logits before scale and bias.
        base: ``[(2 + N) N]`` fp32 biases in the same layout; scale: ``[3]`` fp32.
        streams: ``[T, N, D]`` the residual streams.
        eps: ``hc_eps``; iters: ``hc_sinkhorn_iters`` (>= 1).

    Returns:
        ``post [T, N]`` fp32, ``comb [T, N, N]`` fp32 (doubly stochastic up to eps), and
        ``collapsed [T, D]`` in the streams' dtype.
    """
    T, N, D = streams.shape
    assert mixes.shape == (T, (2 + N) * N) and base.shape == ((2 + N) * N,) and scale.shape == (3,) and iters >= 1
    mixes, base, scale = mixes.float(), base.float(), scale.float()
    pre_w, post_w, comb_w = mixes.split([N, N, N * N], dim=-1)
    pre_b, post_b, comb_b = base.split([N, N, N * N])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(T, N, N) * scale[2] + comb_b.view(N, N), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    collapsed = (pre[..., None] * streams).sum(dim=1).to(streams.dtype)
    return post, comb, collapsed
