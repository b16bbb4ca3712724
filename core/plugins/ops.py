"""Kernel lookup: an op's dispatcher, which picks a backend per call's device.

Layers fetch their ops once, at construction, so that the forward pass pays no registry lookup.
"""

from __future__ import annotations

from collections.abc import Callable

from layerzoo.plugins.manager import get_registry


def kernel(op: str) -> Callable:
    return get_registry().kernel(op)
