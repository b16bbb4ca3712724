"""Kernel ops: each op's registered backends, and the choice of one per call.

Plugins register ``(op, backend, fn)`` through the ``register_kernels`` hook. A call runs the
backend chosen for its tensors' device: ``triton`` on CUDA when the op has a Triton kernel and
triton imports, ``cpp`` on CPU when the op has a C++ kernel (not inside a compiled step, where
inductor fuses the torch ops instead), ``torch`` otherwise. ``LAYERZOO_KERNEL_BACKEND=torch|triton|cpp``
overrides the choice (``triton`` on CPU runs the kernels under ``TRITON_INTERPRET=1``, for tests).
A backend that cannot serve a call raises `KernelUnsupported`; the op then runs its torch
implementation and logs the reason once.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable, Mapping
from typing import Any

from layerzoo import settings
from layerzoo.errors import KernelUnsupported, PluginError
from layerzoo.plugins.lazy import resolve_object

log = logging.getLogger(__name__)

BACKEND_ENV = "LAYERZOO_KERNEL_BACKEND"
FALLBACK = "torch"


# Backends a ``torch.compile``'d CPU step calls as they are: the C++ ops register their shapes
# (`layerzoo.kernels.cpp_build`), so the step calls them as extern kernels. Any other CPU backend
# takes the torch one inside a compiled step, which inductor traces and fuses.
TRACEABLE = frozenset({"cpp", FALLBACK})


def _compiling() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.compiler.is_compiling()


def _device_type(args, kwargs) -> str:
    device = getattr(args[0], "device", None) if args else None
    if device is not None:  # the usual call: a tensor first (a decode step makes ~250 calls)
        return device.type
    for value in (*args, *kwargs.values()):
        device = getattr(value, "device", None)
        if device is not None:
            return device.type
    return "cpu"


class KernelOp:
    """One op: calls the backend chosen for the call's device, falling back to torch."""

    def __init__(self, name: str, backends: Mapping[str, Any], env: Mapping[str, str] | None = None):
        if FALLBACK not in backends:
            raise PluginError(f"kernel op {name!r} has no {FALLBACK!r} backend (registered: {sorted(backends)})")
        self.name = name
        self.backends = dict(backends)
        self.override = settings.text(BACKEND_ENV, env)
        self._chosen: dict[str, tuple[str, Callable]] = {}
        self._reported: set[str] = set()
        self.fallbacks: dict[str, int] = {}
        self._fallback_fn: Callable | None = None

    def choose(self, device_type: str) -> tuple[str, str]:
        """``(backend, why)`` for calls on ``device_type``."""
        if self.override:
            if self.override in self.backends:
                return self.override, f"{BACKEND_ENV}={self.override}"
            return FALLBACK, f"{BACKEND_ENV}={self.override} but op has no such backend"
        if device_type == "cuda" and "triton" in self.backends:
            return "triton", "cuda tensors"
        if device_type == "cpu" and "cpp" in self.backends:
            return "cpp", "cpu tensors"
        return FALLBACK, f"{device_type} tensors"

    def _impl(self, device_type: str) -> tuple[str, Callable]:
        chosen = self._chosen.get(device_type)
        if chosen is None:
            backend, _ = self.choose(device_type)
            try:
                chosen = backend, resolve_object(self.backends[backend])
            except ImportError as exc:  # e.g. triton not installed
                self._report(f"{backend} backend unavailable ({exc})")
                chosen = FALLBACK, resolve_object(self.backends[FALLBACK])
            self._chosen[device_type] = chosen
            self._fallback()  # resolved now, outside any traced step that may need it
        return chosen

    def native(self, device_type: str) -> bool:
        """Whether calls on ``device_type`` run a backend of their own rather than the torch one.
        A fused op whose reference is only its parts in sequence is worth calling only then."""
        return self._impl(device_type)[0] != FALLBACK

    def _report(self, reason: str) -> None:
        self.fallbacks[reason] = self.fallbacks.get(reason, 0) + 1
        if reason not in self._reported:
            self._reported.add(reason)
            log.info("kernel %s falls back to %s: %s", self.name, FALLBACK, reason)

    def _fallback(self) -> Callable:
        if self._fallback_fn is None:
            self._fallback_fn = resolve_object(self.backends[FALLBACK])
        return self._fallback_fn

    def __call__(self, *args, **kwargs):
        device_type = _device_type(args, kwargs)
        backend, fn = self._impl(device_type)
        if backend not in TRACEABLE and device_type == "cpu" and _compiling():
            return self._fallback()(*args, **kwargs)
        if backend == FALLBACK:
            return fn(*args, **kwargs)
        try:
            return fn(*args, **kwargs)
        except KernelUnsupported as exc:
            self._report(str(exc))
            return self._fallback()(*args, **kwargs)


def kernel_ops(registry) -> dict[str, dict[str, Any]]:
    """``op -> {backend: registration}`` from a plugin registry's kernel table."""
    ops: dict[str, dict[str, Any]] = {}
    for (op, backend), reg in registry.kernels.entries.items():
        ops.setdefault(op, {})[backend] = reg
    return ops


def kernels_report(registry, device_type: str) -> list[dict[str, Any]]:
    """Every op, its backends (with the plugin of each) and the one that runs on ``device_type``."""
    rows = []
    for op, regs in sorted(kernel_ops(registry).items()):
        runs, why = KernelOp(op, {b: r.target for b, r in regs.items()}).choose(device_type) if FALLBACK in regs else (None, "no torch backend")
        rows.append({"op": op, "backends": {b: r.plugin for b, r in sorted(regs.items())}, "runs_here": runs, "why": why})
    return rows
