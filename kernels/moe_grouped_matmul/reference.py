"""Routed SwiGLU experts in plain torch (the CPU path and the kernels' reference), grouped by
sorting: the (token, expert) pairs are ordered by expert so that each expert runs one matmul pair
over all of its rows, instead of one small matmul per token. ``limit`` clamps the SwiGLU as
GLM-5.3-Flash's experts do (`clamped_swiglu`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from layerzoo.kernels.silu_and_mul.reference import silu_and_mul


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) · clamp(up, -limit, limit)``, in the inputs' dtype."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def fused_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
    *, limit: float | None = None,
) -> torch.Tensor:
    """``out[t] = Σ_j weights[t, j] · down_e(silu(gate_e(x[t])) · up_e(x[t]))`` with ``e = ids[t, j]``
    (with ``limit``: ``silu(min(gate, limit)) · clamp(up, -limit, limit)``).

    Args:
        x: ``[T, H]`` tokens.
        w13: ``[E, 2I, H]``, each expert's gate rows (the first ``I``) over its up rows.
        w2: ``[E, H, I]``, each expert's down projection.
        weights: ``[T, k]`` routing weights (any float dtype; applied in fp32).
        ids: ``[T, k]`` int64 expert ids.
        limit: None (plain SwiGLU) or the clamp of GLM-5.3-Flash's experts.
    Returns:
        ``[T, H]`` in ``x``'s dtype; the k contributions of a token are summed in fp32.
    """
    num_experts, top_k = w13.shape[0], ids.shape[1]
    flat = ids.reshape(-1)  # pair p = (token p // k, slot p % k)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    token_of = order // top_k
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    # [T*k, H], rows of expert 0 first, then expert 1, ... (index_select: advanced indexing is slow on CPU)
    routed = x.index_select(0, token_of)
    out_rows = torch.empty_like(routed)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = routed[start : start + count]
        gate, up = F.linear(rows, w13[expert]).chunk(2, dim=-1)
        act = silu_and_mul(gate, up) if limit is None else clamped_swiglu(gate, up, limit)
        out_rows[start : start + count] = F.linear(act, w2[expert])
        start += count
    contributions = out_rows.float() * weights.reshape(-1).index_select(0, order)[:, None].float()
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token_of, contributions)
    return out.to(x.dtype)
