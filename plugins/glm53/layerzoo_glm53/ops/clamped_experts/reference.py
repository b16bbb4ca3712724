"""Routed experts with GLM-5.3-Flash's clamped SwiGLU, plain torch (the CPU path and the reference).

``out[t] = Σ_j weights[t, j] · down_e(silu(min(gate_e x, L)) · clamp(up_e x, -L, L))``, ``e = ids[t, j]``,
in the layout of the core's `StackedExperts` (``w13 [E, 2I, H]`` gate rows over up rows, ``w2 [E, H,
I]``). As the core's ``moe_grouped_matmul`` reference: the (token, expert) pairs are grouped by
expert by sorting, each expert runs one matmul pair over its rows, the k contributions of a token
are summed in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """``silu(min(gate, limit)) · clamp(up, -limit, limit)``, in the inputs' dtype."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def clamped_experts(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, limit: float
) -> torch.Tensor:
    """``x [T, H]``, ``w13 [E, 2I, H]``, ``w2 [E, H, I]``, ``weights, ids [T, k]`` → ``[T, H]`` in ``x``'s dtype."""
    num_experts, top_k = w13.shape[0], ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token_of = order // top_k
    routed = x.index_select(0, token_of)
    out_rows = torch.empty_like(routed)
    start = 0
    for expert, count in enumerate(torch.bincount(flat, minlength=num_experts).tolist()):
        if count:
            rows = slice(start, start + count)
            gate, up = F.linear(routed[rows], w13[expert]).chunk(2, dim=-1)
            out_rows[rows] = F.linear(clamped_swiglu(gate, up, limit), w2[expert])
            start += count
    contributions = out_rows.float() * weights.reshape(-1).index_select(0, order)[:, None].float()
    return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token_of, contributions).to(x.dtype)
