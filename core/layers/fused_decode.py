"""A pre-norm attention + SwiGLU layer's decode step as one C++ call (``layerzoo_cpu::decode_layer``).

The Python path of such a layer makes ~25 calls between its four GEMVs. Each GEMV streams the
layer's weights through the CPU's caches and evicts what the interpreter works with, so inside a
step that Python ran 3-5x slower than alone (the 0.6B in fp32 on a 2-core Xeon: ~25 ms of a 165 ms
token between the linears, ~9 ms with the GEMVs stubbed). The C++ op runs the same ops in the same
order on the same arguments (bitwise the Python result) without returning to the interpreter.

Only the plain case takes it, decided once per layer (`plan_for`) and per step (`DecodePlan.run`):
the core's own `Attention`, `GatedMLP` and `RMSNorm` classes (a subclass may change the math), fused
qkv and gate/up projections whose linear method has a few-row kernel the call can make (dense
fp32 or bf16 packed, GGUF blocks, 4-bit groups, FP8: `LinearMethod.fused_part`), one process (no
tensor-parallel reduce), every op on its C++ backend, and a step the KV pool can hand over
(`PagedKVCache.decode_operands`: all rows decoding, or short chunks such as speculative verifies
and short prompts as row queries; no FP8 KV) with no more rows than the GEMVs take. Anything else
runs the Python path.
``LAYERZOO_FUSED_DECODE=0`` turns it off.
"""

from __future__ import annotations

import logging

import attrs
import torch

from layerzoo import settings
from layerzoo.distributed import parallel_state
from layerzoo.kernels import cpp_build
from layerzoo.layers.attention import Attention
from layerzoo.layers.linear_method import FusedPart, LinearMethod
from layerzoo.layers.mlp import GatedMLP
from layerzoo.layers.norm import RMSNorm
from layerzoo.plugins.ops import kernel

log = logging.getLogger(__name__)

ENV = "LAYERZOO_FUSED_DECODE"
# The ops the fused call makes; each must run its C++ backend here (a backend override or a
# fallback elsewhere keeps the Python path, which honours it).
OPS = ("rms_norm", "qk_norm_rotary", "kv_cache_write", "paged_decode_attention", "silu_and_mul")
TENSORS_PER_LINEAR = 3  # the `weights` entries of a linear (decode_layer_cpu.cpp's kTensors)


@attrs.frozen
class DecodePlan:
    """What one layer's fused decode call takes besides the step's tensors."""

    layer_index: int
    dtype: torch.dtype
    max_rows: int  # the fewest rows any of its four GEMVs takes
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    eps: float
    qk_eps: float
    scale: float
    heads: tuple[int, int, int]  # Hq, Hkv, D
    # qkv, o, gate_up, down: each its count of linears, then (w_ptr, N, K, w_bytes, block) a linear
    linears: tuple[int, ...]
    biases: tuple[torch.Tensor | None, ...]  # a linear each
    weights: tuple[torch.Tensor | None, ...]  # three a linear: the tensors its format passes by value, None-padded
    # the layer's own ops the call stands in for: asked each step whether they still run natively,
    # as the Python path asks (a flipped answer sends the step there)
    ops: tuple
    runs: list = attrs.field(factory=lambda: [0, 0])  # steps taken, their rows (a list: the plan is frozen)

    @property
    def block_fields(self) -> tuple[int, ...]:
        """Each linear's block field, in order: which kernel the call runs it with."""
        out, i = [], 0
        while i < len(self.linears):
            count = self.linears[i]
            out += [self.linears[i + 5 * j + 5] for j in range(count)]
            i += 1 + 5 * count
        return tuple(out)

    def run(self, hidden: torch.Tensor, residual: torch.Tensor | None, ctx):
        """``(hidden, residual)`` after the layer, or None when this step must take the Python path."""
        if hidden.dtype != self.dtype or not 0 < hidden.shape[0] <= self.max_rows:
            return None
        if not all(op.native("cpu") for op in self.ops):
            return None
        operands = getattr(ctx.kv_cache, "decode_operands", None)
        operands = operands(self.layer_index, ctx) if operands is not None else None
        if operands is None:
            return None
        cos, sin = ctx.cos_sin
        if cos.dtype != self.dtype:
            return None
        k_cache, v_cache, slots, tables, lens = operands
        self.runs[0] += 1
        self.runs[1] += hidden.shape[0]
        return torch.ops.layerzoo_cpu.decode_layer.default(
            hidden, residual, self.input_norm, self.post_norm, self.q_norm, self.k_norm, self.eps, self.qk_eps, cos, sin,
            k_cache, v_cache, slots, tables, lens, self.scale, self.heads, self.linears, self.biases, self.weights)


def _linear_part(linear) -> FusedPart | None:
    """How the fused call runs a linear: its linear method answers (a plain ``nn.Linear``, left
    unpacked, has none)."""
    return linear.fused_part() if isinstance(linear, LinearMethod) else None


def _projection(module, fused: str, apart: tuple[str, ...]) -> list:
    """A projection's linears: the fused one, or its parts where their formats kept them apart
    (e.g. q/k in Q4_K and v in Q6_K); the call concatenates the parts' outputs."""
    linear = getattr(module, fused)
    return [linear] if linear is not None else [getattr(module, name) for name in apart]


def _not_plain(module, cls) -> str | None:
    return None if type(module) is cls else f"{type(module).__name__} is not the core's {cls.__name__}"


_reported: set[str] = set()


def _op_by_op(layer, why: str) -> None:
    """No plan: logs why, once per reason (naming the first layer it held for)."""
    if why not in _reported:
        _reported.add(why)
        log.info("layer %d (%s) runs op by op, not as one fused C++ call: %s", layer.layer_index, type(layer).__name__, why)
    return None


def plan_for(layer) -> DecodePlan | None:
    """The fused decode plan of a `PreNormDecoderLayer`, or None (logged) where it must run in Python."""
    if not settings.flag(ENV):
        return _op_by_op(layer, f"{ENV}=0")
    if parallel_state.is_parallel():
        return _op_by_op(layer, "tensor parallel (the call has no all-reduce)")
    if not cpp_build.available():
        return _op_by_op(layer, f"the C++ kernels are off ({cpp_build.why_unavailable()})")
    attn, mlp = layer.self_attn, layer.mlp
    pairs = [(attn, Attention), (mlp, GatedMLP), (layer.input_layernorm, RMSNorm), (layer.post_attention_layernorm, RMSNorm)]
    for module, cls in pairs:
        if (why := _not_plain(module, cls)) is not None:
            return _op_by_op(layer, why)
    if attn.fp8_kv is not None:
        return _op_by_op(layer, "an FP8 KV cache")
    if attn.qk_norm:
        why = _not_plain(attn.q_norm, RMSNorm) or _not_plain(attn.k_norm, RMSNorm)
        if why is not None:
            return _op_by_op(layer, f"QK-norm: {why}")
    backends = {op: kernel(op).choose("cpu")[0] for op in OPS}
    off = [f"{op} on {backend}" for op, backend in backends.items() if backend != "cpp"]
    if off:
        return _op_by_op(layer, f"ops not on their C++ backend: {', '.join(off)}")
    projections = [_projection(attn, "qkv", ("q_proj", "k_proj", "v_proj")), [attn.o_proj],
                   _projection(mlp, "gate_up", ("gate_proj", "up_proj")), [mlp.down_proj]]
    groups = [[_linear_part(lin) for lin in linears] for linears in projections]
    parts = [p for group in groups for p in group]
    if any(p is None for p in parts):
        return _op_by_op(layer, "a linear whose method has no fused decode kernel")
    dtype = parts[0].dtype
    norms = [layer.input_layernorm.weight, layer.post_attention_layernorm.weight]
    if attn.qk_norm:
        norms += [attn.q_norm.weight, attn.k_norm.weight]
    if any(p.dtype != dtype for p in parts) or any(w.dtype != dtype or w.device.type != "cpu" for w in norms):
        return _op_by_op(layer, "its linears and norms differ in dtype or device")
    if layer.input_layernorm.eps != layer.post_attention_layernorm.eps:
        return _op_by_op(layer, "its two norms differ in eps")
    return DecodePlan(
        layer_index=attn.layer_index,
        dtype=dtype,
        max_rows=min(p.rows for p in parts),
        input_norm=norms[0].detach(),
        post_norm=norms[1].detach(),
        q_norm=attn.q_norm.weight.detach() if attn.qk_norm else None,
        k_norm=attn.k_norm.weight.detach() if attn.qk_norm else None,
        eps=float(layer.input_layernorm.eps),
        qk_eps=float(attn.q_norm.eps) if attn.qk_norm else 0.0,
        scale=float(attn.scaling),
        heads=(attn.num_heads, attn.num_kv_heads, attn.head_dim),
        linears=tuple(f for group in groups for f in (len(group), *(f for p in group for f in p.fields))),
        biases=tuple(p.bias for p in parts),
        weights=tuple(t for p in parts for t in (*p.tensors, None, None, None)[:TENSORS_PER_LINEAR]),
        ops=(attn._qk_norm_rotary, kernel("rms_norm"), kernel("silu_and_mul")),  # the KV pool asks for its own
    )
