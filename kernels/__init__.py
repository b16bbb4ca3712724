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
    "qk_norm_rotary": ("qk_norm_rotary", "qk_norm_rotary"),
    "kv_cache_write": ("kv_cache_write", "kv_cache_write"),
    "paged_decode_attention": ("paged_attention", "paged_decode_attention"),
    "paged_prefill_attention": ("paged_attention", "paged_prefill_attention"),
    "paged_decode_attention_static": ("paged_attention", "paged_decode_attention_static"),
    "fp8_quantize": ("fp8_kv", "quantize_fp8"),
    "fp8_dequantize": ("fp8_kv", "dequantize_fp8"),
    "moe_softmax_topk": ("moe_routing", "softmax_topk"),
    "moe_sigmoid_grouped_topk": ("moe_routing", "sigmoid_grouped_topk"),
    "moe_grouped_matmul": ("moe_grouped_matmul", "fused_experts"),
    # each row times its own expert's MXFP4 weight, kept packed (Kimi K3's routed experts)
    "mxfp4_expert_matmul": ("mxfp4_matmul", "expert_matmul"),
    "top_k_top_p": ("sampling", "top_k_top_p_filter"),
    "apply_token_bitmask": ("sampling", "apply_token_bitmask"),  # structured outputs' grammar masks
    "argmax_finite": ("argmax", "argmax_finite"),
    # the short depthwise conv in front of every linear-attention / SSM mixer (GDN, KDA, Mamba2)
    "causal_conv1d": ("causal_conv1d", "causal_conv1d"),
    "causal_conv1d_update": ("causal_conv1d", "causal_conv1d_update"),
    # the gated delta rule of Gated DeltaNet (Qwen3-Next, Qwen3.5: g [T, H]) and Kimi Delta Attention
    # (Kimi Linear, Kimi K3, GLM-5.3-Flash: g [T, H, K]): prefill in chunks, short pieces step by
    # step, decode rows in place over their pool slots (no host read)
    "delta_rule_chunk": ("delta_rule", "chunk_delta_rule"),
    "delta_rule_recurrent": ("delta_rule", "recurrent_delta_rule"),
    "delta_rule_decode": ("delta_rule", "delta_rule_decode"),
}

_HERE = Path(__file__).parent

# Ops with a C++ CPU backend (built by `cpp_build`), chosen for CPU tensors, in compiled steps too
# (each op registers its shapes, so a compiled step calls it as an extern kernel).
CPP_OPS: dict[str, str] = {
    "rms_norm": "rms_norm.cpp:rms_norm",
    "rotary_embedding": "rotary.cpp:apply_rotary",
    "silu_and_mul": "silu_and_mul.cpp:silu_and_mul",
    "qk_norm_rotary": "qk_norm_rotary.cpp:qk_norm_rotary",
    "argmax_finite": "argmax.cpp:argmax_finite",
    "kv_cache_write": "kv_cache_write.cpp:kv_cache_write",
    "paged_decode_attention": "paged_attention.cpp:paged_decode_attention",
    "paged_prefill_attention": "paged_attention.cpp:paged_prefill_attention",  # short chunks only
    # reads only each row's first context_lens tokens: the static contract holds (padding never read)
    "paged_decode_attention_static": "paged_attention.cpp:paged_decode_attention",
    # reads each expert's row count on the host: only for eager steps (K3's experts are never captured)
    "mxfp4_expert_matmul": "mxfp4_matmul.cpu:expert_matmul",
}


def folder_backends(package: str, root: Path, folder: str, function: str) -> dict[str, str]:
    """``backend -> "module:function"`` for the backend files present in an op folder.

    ``root`` is the directory of ``package``; the folder holds ``reference.py`` (backend
    ``torch``) and, where written, ``triton.py``. Plugins with their own op folders use this too.
    """
    found = {}
    for backend, module in (("torch", "reference"), ("triton", "triton")):
        if (root / folder / f"{module}.py").exists():
            found[backend] = f"{package}.{folder}.{module}:{function}"
    return found


def register_op_folders(register, package: str, root: Path, ops: dict[str, tuple[str, str]]) -> None:
    """Register every backend of every op in an ``op -> (folder, function)`` table (lazy strings)."""
    for op, (folder, function) in ops.items():
        for backend, target in folder_backends(package, root, folder, function).items():
            register(op, backend, target)


def backends_of(op: str) -> dict[str, str]:
    """``backend -> "module:function"`` of one of the shared ops."""
    return folder_backends(__name__, _HERE, *OPS[op])


@hookimpl
def register_kernels(register):
    register_op_folders(register, __name__, _HERE, OPS)
    for op, target in CPP_OPS.items():
        register(op, "cpp", f"{__name__}.{target}")
