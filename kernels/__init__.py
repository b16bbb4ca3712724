"""Shared kernel ops, one folder each: ``reference.py`` (plain torch, the CPU path) and, where
written, ``triton.py`` (the GPU kernel, same signature, tested against the reference under
``TRITON_INTERPRET=1``).

This module is a built-in plugin: it registers every op's backends through ``register_kernels``
as lazy ``"module:function"`` strings, so listing plugins imports no kernel code (and no triton).
A backend is registered when its file exists in the op's folder.
"""

from __future__ import annotations

from pathlib import Path

from layerzoo.hookspecs import hookimpl

# op name -> (folder, function name in reference.py and triton.py)
OPS: dict[str, tuple[str, str]] = {
    "rms_norm": ("rms_norm", "rms_norm"),
    "rotary_embedding": ("rotary", "apply_rotary"),
    "silu_and_mul": ("silu_and_mul", "silu_and_mul"),
    "paged_decode_attention": ("paged_attention", "paged_decode_attention"),
    "paged_prefill_attention": ("paged_attention", "paged_prefill_attention"),
    "fp8_quantize": ("fp8_kv", "quantize_fp8"),
    "fp8_dequantize": ("fp8_kv", "dequantize_fp8"),
    "moe_softmax_topk": ("moe_routing", "softmax_topk"),
    "moe_sigmoid_grouped_topk": ("moe_routing", "sigmoid_grouped_topk"),
    "moe_grouped_matmul": ("moe_grouped_matmul", "fused_experts"),
    "top_k_top_p": ("sampling", "top_k_top_p_filter"),
}

_HERE = Path(__file__).parent


def backends_of(op: str) -> dict[str, str]:
    """``backend -> "module:function"`` for the files present in the op's folder."""
    folder, function = OPS[op]
    found = {}
    for backend, module in (("torch", "reference"), ("triton", "triton")):
        if (_HERE / folder / f"{module}.py").exists():
            found[backend] = f"layerzoo.kernels.{folder}.{module}:{function}"
    return found


@hookimpl
def register_kernels(register):
    for op in OPS:
        for backend, target in backends_of(op).items():
            register(op, backend, target)
