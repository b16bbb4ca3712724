"""Depthwise causal conv1d (width ``W``) with a conv state, in plain torch (fp32 inside).

For channel ``d`` and a sequence whose inputs are preceded by its conv state (the last ``W - 1`` raw
inputs before it, oldest first)::

    y_t[d] = act(bias[d] + Σ_{w<W} weight[d, w] · x_{t - (W-1) + w}[d])

and the new conv state is the last ``W - 1`` raw inputs, the old state included when the sequence
is shorter than ``W - 1``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from layerzoo.kernels.varlen import check_state, from_padded, padded_len, seq_bounds, to_padded

ACTIVATIONS = ("silu", "swish", None)


def _activate(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation not in ACTIVATIONS:
        raise ValueError(f"causal_conv1d: activation must be 'silu' or None, got {activation!r}")
    return y if activation is None else F.silu(y)


def causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    conv_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal conv over one sequence or a varlen batch (prefill).

    Args:
        x: ``[T, D]``.
        weight: ``[D, W]``; bias: ``[D]`` or None.
        conv_state: ``[N, D, W-1]`` raw inputs preceding each sequence (oldest first), or None (zeros).
        cu_seqlens: ``[N + 1]`` int64 offsets into ``T``, or None for one sequence.
        activation: ``"silu"`` or None.

    Returns:
        ``(y [T, D] in x.dtype, final_conv_state [N, D, W-1])``, the state in ``conv_state``'s dtype
        (``x``'s when None).
    """
    T, D = x.shape
    W = weight.shape[-1]
    if weight.shape != (D, W) or (bias is not None and bias.shape != (D,)):
        raise ValueError(f"causal_conv1d: weight must be [D, W] and bias [D] for x {list(x.shape)}, got "
                         f"{list(weight.shape)} and {None if bias is None else list(bias.shape)}")
    starts, lens = seq_bounds(cu_seqlens, T, x.device)
    N = lens.shape[0]
    check_state("conv_state", conv_state, (N, D, W - 1))
    Lp = padded_len(lens)
    state = torch.zeros(N, D, W - 1, device=x.device) if conv_state is None else conv_state.float()
    # [N, W-1+Lp, D]: each sequence's state then its inputs
    xs = torch.cat([state.transpose(1, 2), to_padded(x.float(), starts, lens, Lp)], dim=1)
    w = weight.float()
    y = sum(w[:, i] * xs[:, i : i + Lp] for i in range(W))  # [N, Lp, D]
    if bias is not None:
        y = y + bias.float()
    y = from_padded(_activate(y, activation), starts, lens, T).to(x.dtype)
    # the last W-1 rows before each sequence's padding: xs rows len .. len+W-2
    idx = lens[:, None] + torch.arange(W - 1, device=x.device)  # [N, W-1]
    final = xs.gather(1, idx[:, :, None].expand(N, W - 1, D)).transpose(1, 2)
    return y, final.to(x.dtype if conv_state is None else conv_state.dtype)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    activation: str | None = "silu",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One new token per sequence (decode); functional, ``conv_state`` is not modified.

    Args:
        x: ``[B, D]``; conv_state: ``[B, D, W-1]``; weight: ``[D, W]``; bias: ``[D]`` or None.

    Returns:
        ``(y [B, D] in x.dtype, new_conv_state [B, D, W-1] in conv_state.dtype)``.
    """
    B, D = x.shape
    W = weight.shape[-1]
    check_state("conv_state", conv_state, (B, D, W - 1))
    window = torch.cat([conv_state.float(), x.float()[:, :, None]], dim=-1)  # [B, D, W], oldest first
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return _activate(y, activation).to(x.dtype), window[:, :, 1:].to(conv_state.dtype)
