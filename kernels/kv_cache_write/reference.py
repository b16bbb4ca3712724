"""A step's keys and values into their paged-cache slots, in plain torch."""

from __future__ import annotations

import torch


def kv_cache_write(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    """Store token ``t``'s rows at slot ``slots[t]`` (``block * block_size + offset``), in place.

    Args:
        k, v: ``[T, Hkv, D]`` (cast to the caches' dtype).
        k_cache, v_cache: ``[N, block_size, Hkv, D]``, written.
        slots: ``[T]`` int64.
    """
    for x, cache in ((k, k_cache), (v, v_cache)):
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slots, x.to(cache.dtype))
