"""Greedy token choice with the finiteness screen, in plain torch."""

from __future__ import annotations

import torch


def argmax_finite(logits: torch.Tensor) -> torch.Tensor:
    """``logits [B, V]`` → ``[B]`` int64: each row's first largest index (``torch.argmax``), or -1
    where the row holds a NaN or an infinity."""
    ids = logits.argmax(dim=-1)
    return ids.masked_fill(~torch.isfinite(logits).all(dim=-1), -1)
