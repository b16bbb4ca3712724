"""Kernel lookup for layers: the registered implementation of an op for this run's backend.

Layers resolve their ops once, at construction, so that the forward pass pays no lookup. The
selection by device and the per-call fallbacks come with the kernel registry; until then every
op runs its torch implementation.
"""

from __future__ import annotations

from collections.abc import Callable

from layerzoo.plugins import get_registry


def kernel(op: str, backend: str = "torch") -> Callable:
    return get_registry().kernel(op, backend)
