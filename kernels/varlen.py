"""What the ssm ops share: sequence bounds from ``cu_seqlens`` and the (un)padding that lets the
torch references process a varlen batch as one padded ``[N, L, ...]`` batch, plus the input checks
of the Triton wrappers.

Padding is harmless for every recurrence here: padded steps carry a zero decay exponent
(``g = 0``, ``dt = 0``) and a zero update (``beta = 0``, ``dt = 0``), so the state passes them
unchanged, and their outputs are dropped.
"""

from __future__ import annotations

import torch


def seq_bounds(cu_seqlens: torch.Tensor | None, T: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """``(starts [N], lens [N])`` int64: one sequence of ``T`` tokens when ``cu_seqlens`` is None."""
    if cu_seqlens is None:
        return torch.zeros(1, dtype=torch.long, device=device), torch.full((1,), T, dtype=torch.long, device=device)
    cu = cu_seqlens.to(device=device, dtype=torch.long)
    if cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seqlens must be [N + 1] offsets, got shape {tuple(cu_seqlens.shape)}")
    if int(cu[0]) != 0 or int(cu[-1]) != T or bool((cu[1:] < cu[:-1]).any()):
        raise ValueError(f"cu_seqlens must rise from 0 to T = {T}, got {cu.tolist()}")
    return cu[:-1], cu[1:] - cu[:-1]


def to_padded(x: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, Lp: int) -> torch.Tensor:
    """``x [T, ...]`` → ``[N, Lp, ...]``: row ``i`` of sequence ``n`` is ``x[starts[n] + i]`` for
    ``i < lens[n]``, zero beyond."""
    i = torch.arange(Lp, device=x.device)
    valid = i[None, :] < lens[:, None]  # [N, Lp]
    idx = (starts[:, None] + i[None, :]).where(valid, 0)
    if x.shape[0] == 0:
        return x.new_zeros((starts.shape[0], Lp, *x.shape[1:]))
    out = x[idx]
    return out.masked_fill(~valid.view(*valid.shape, *([1] * (x.dim() - 1))), 0)


def from_padded(xp: torch.Tensor, starts: torch.Tensor, lens: torch.Tensor, T: int) -> torch.Tensor:
    """Inverse of `to_padded`: ``[N, Lp, ...]`` → ``[T, ...]`` (the padded rows dropped)."""
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=xp.device), lens, output_size=T)
    pos = torch.arange(T, device=xp.device) - starts[seq]
    return xp[seq, pos]


def padded_len(lens: torch.Tensor, multiple: int = 1) -> int:
    """The longest length rounded up to ``multiple`` (at least ``multiple``; one host sync)."""
    longest = int(lens.max()) if lens.numel() else 0
    return max(1, -(-longest // multiple)) * multiple


def check_state(name: str, state: torch.Tensor | None, shape: tuple[int, ...]) -> None:
    if state is not None and tuple(state.shape) != tuple(shape):
        raise ValueError(f"{name} must be {list(shape)}, got {list(state.shape)}")
