"""Shared kernel ops, one folder each (``reference.py`` is plain torch and runs anywhere).

This module is a built-in plugin: it registers every shared op's torch implementation through
the ``register_kernels`` hook, lazily, so listing plugins imports no kernel code.
"""

from __future__ import annotations

from layerzoo.hookspecs import hookimpl

TORCH_OPS = {
    "rms_norm": "layerzoo.kernels.rms_norm.reference:rms_norm",
    "rotary_embedding": "layerzoo.kernels.rotary.reference:apply_rotary",
    "silu_and_mul": "layerzoo.kernels.silu_and_mul.reference:silu_and_mul",
}


@hookimpl
def register_kernels(register):
    for op, fn in TORCH_OPS.items():
        register(op, "torch", fn)
