"""Lazy ``"module:attr"`` references: how plugins name classes and kernels without importing them.

Registration hooks pass these strings so that loading a plugin imports no torch code; the core
resolves one when it is first needed.
"""

from __future__ import annotations

import importlib
from typing import Any

from layerzoo.errors import PluginError


def resolve_object(target: str | Any) -> Any:
    """Import a lazy ``"module:attr"`` reference; anything else is returned as it is."""
    if not isinstance(target, str):
        return target
    module_name, sep, attr = target.partition(":")
    if not sep or not module_name or not attr:
        raise PluginError(f"lazy reference {target!r} is not of the form 'module:attr'")
    obj = importlib.import_module(module_name)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj
