"""CPU weight packing for linear layers, prepared once at load: oneDNN's blocked fp32 layout, or
int8 weights with a scale per 32 inputs (``quantization="int8"``: `layerzoo.layers.gguf_linear`).

MKL's sgemm repacks the weight on every call, which costs more than the matmul itself when only a
few rows are multiplied (decode): measured here, a prepacked oneDNN linear reads weights ~2x
faster at 1–32 rows and is ~1.2x faster at 1000. Packing happens after the strict load, on CPU
fp32 weights (and bf16 ones on a CPU with native bf16, `packable_dtypes`);
``LAYERZOO_CPU_PACKED_LINEAR=0`` turns it off.
"""

from __future__ import annotations

import logging
import types

import torch
from torch import nn

from layerzoo import settings

log = logging.getLogger(__name__)

ENV = "LAYERZOO_CPU_PACKED_LINEAR"


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def packable_dtypes() -> frozenset[torch.dtype]:
    """Weight dtypes oneDNN packs here: fp32 always; bf16 only on a CPU with native bf16 support
    (AVX-512 BF16 / AMX / AVX-NE-CONVERT: ``mkldnn._is_mkldnn_bf16_supported``). Elsewhere oneDNN
    refuses to pack bf16 and bf16 linears stay plain ``F.linear`` (converted, slower than fp32:
    keep fp32 the default on such CPUs)."""
    dtypes = {torch.float32}
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        dtypes.add(torch.bfloat16)
    return frozenset(dtypes)


@torch.library.custom_op("layerzoo::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """``x [N, in] -> [N, out]`` through a oneDNN-packed weight, as an opaque op for ``torch.compile``
    (inductor cannot lower the packed call itself; it calls this as an extern kernel)."""
    return torch.ops.mkldnn._linear_pointwise(x, packed_weight, bias, "none", [], "")


@packed_linear.register_fake
def _packed_linear_shape(x, packed_weight, bias, out_features):
    return x.new_empty(x.shape[0], out_features)


# Up to this many rows (decode steps, speculative verifies, short continuations) a packed fp32 or
# bf16 linear runs the C++ kernel that reads oneDNN's packed buffer itself (layerzoo.kernels.cpu_gemv,
# packed_fp32.cpp / packed_bf16.cpp) where the layer's layout check passed at load. On a Zen 5 (2
# threads) the fp32 one streams 1 GB of weights 1.0-1.15x as fast as oneDNN's own GEMM at 1-32
# rows, and on cache-resident weights (the embedded model) it runs 1.2-2.5x as fast, since oneDNN's
# per-call cost dominates; the bf16 one streams 1.1-1.6x as fast as oneDNN's bf16 GEMM at 1-16 rows.
FP32_GEMV_MAX_ROWS = 32  # the kernels' accumulators for one block (kMaxRows in packed_*.cpp)
FP32_GEMV_ROWS = min(settings.integer("LAYERZOO_FP32_GEMV_ROWS"), FP32_GEMV_MAX_ROWS)
# Where the CPU has AMX, oneDNN multiplies bf16 with its tiles (and packs AB16b32a2b): on an Intel
# Xeon (2 threads, 0.6B shapes, in turns) the bf16 kernel streamed 1.04-1.17x as fast at 1-4 rows,
# 0.89x at 8, 0.54x at 16, 0.35x at 32, so from 5 rows such a layer keeps oneDNN.
AMX_BF16_GEMV_ROWS = min(settings.integer("LAYERZOO_AMX_BF16_GEMV_ROWS"), FP32_GEMV_ROWS)

# The few-row kernel of each packed dtype. The oneDNN layouts it reads: AB16b64a for fp32 (AVX-512),
# AB16b64a2b for bf16 (AVX-512 BF16), or AB16b32a2b where the CPU has AMX: the bf16 kernel takes
# the block width as its last argument.
_GEMV_OPS = {torch.float32: "packed_fp32_gemv", torch.bfloat16: "packed_bf16_gemv"}
_GEMV_BLOCKS = {torch.float32: (64,), torch.bfloat16: (64, 32)}


def packed_layout_bytes(dtype: torch.dtype, out_features: int, in_features: int, block: int = 64) -> int:
    """Bytes of the oneDNN layout of a ``[N, K]`` weight that the few-row kernel of ``dtype`` reads:
    whole blocks of ``block`` outputs, inputs padded to 16 (fp32) or 32 (bf16, in pairs)."""
    blocks = -(-out_features // block)
    if dtype == torch.float32:
        return blocks * block * -(-in_features // 16) * 16 * 4
    assert dtype == torch.bfloat16, dtype
    return blocks * block * -(-in_features // 32) * 32 * 2


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # A decode step's [T, K] rows go as they are: the reshapes cost ~4 us a call.
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    if self.packed_gemv and 0 < flat.shape[0] <= self.gemv_rows:
        # in a compiled decode step (layerzoo.runtime.decode_capture) an extern call: cpp_build
        # registers its shapes
        out = packed_gemv(self, flat)
    elif torch.compiler.is_compiling():  # inductor cannot lower oneDNN's packed call itself
        out = packed_linear(flat, self.packed_weight, self.bias, self.out_features)
    else:
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed_weight, self.bias, "none", [], "")
    return out if flat is x else out.reshape(*x.shape[:-1], out.shape[-1])


def packed_gemv(self: nn.Linear, flat: torch.Tensor) -> torch.Tensor:
    """``flat [M, K]`` (the layer's dtype) times the layer's oneDNN-packed weight, by the C++ few-row kernel."""
    return self.gemv_op(flat if flat.is_contiguous() else flat.contiguous(), self.packed_address, self.out_features,
                        self.in_features, self.gemv_bias, *self.gemv_layout)


def _bind_gemv(module: nn.Linear, block: int) -> None:
    """The layer's few-row kernel, bias, layout arguments and row limit, looked up once instead of on
    every call (blocks of 32 bf16 outputs are oneDNN's AMX layout: `AMX_BF16_GEMV_ROWS`)."""
    dtype = module.packed_weight.dtype
    module.gemv_rows = AMX_BF16_GEMV_ROWS if dtype == torch.bfloat16 and block == 32 else FP32_GEMV_ROWS
    module.gemv_op = getattr(torch.ops.layerzoo_cpu, _GEMV_OPS[dtype]).default
    module.gemv_bias = None if module.bias is None else module.bias.detach()
    module.gemv_layout = (module.packed_bytes,) if dtype == torch.float32 else (module.packed_bytes, block)


def _packed_gemv_agrees(module: nn.Linear) -> bool | None:
    """Whether the few-row kernel reads this layer's packed weight right, binding it if so: oneDNN
    chooses the layout by CPU and shape, so the buffer must have the size of one the kernel reads
    and one row multiplied both ways at load must agree (which also tells AB16b64a2b from
    AB16b32a2b, alike in size when the outputs fill whole 64s). None where the kernel does not
    apply (off, another dtype, not built, or built without AVX-512 / AVX-512 BF16)."""
    from layerzoo.kernels.cpu_gemv import cpu

    dtype = module.packed_weight.dtype
    if FP32_GEMV_ROWS <= 0 or dtype not in _GEMV_OPS or not cpu.available():
        return None
    probe = torch.randn(1, module.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        want = torch.ops.mkldnn._linear_pointwise(probe, module.packed_weight, module.bias, "none", [], "")
    scale = float(want.abs().max()) or 1.0
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # bf16 outputs: both round once to 8 bits
    for block in _GEMV_BLOCKS[dtype]:
        if module.packed_bytes != packed_layout_bytes(dtype, module.out_features, module.in_features, block):
            continue  # oneDNN chose another layout for this shape (the kernel would refuse it)
        _bind_gemv(module, block)
        with torch.no_grad():
            try:
                got = packed_gemv(module, probe)
            except RuntimeError:  # built without the instructions
                return None
        if got.shape == want.shape and bool(torch.allclose(got.float(), want.float(), rtol=tol, atol=tol * scale)):
            return True
    return False


class CannotFuse(Exception):
    """The parts of a projection are kept in formats that one matmul cannot join."""


def fuse_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One linear whose output is the parts' outputs side by side (weights concatenated by rows).

    Raises `CannotFuse` where the parts are kept in different formats (the module then keeps them
    apart)."""
    from layerzoo.layers.gguf_linear import GGUFLinear, fuse_gguf_linears

    if any(isinstance(p, GGUFLinear) for p in parts):
        fused = fuse_gguf_linears(parts) if all(isinstance(p, GGUFLinear) for p in parts) else None
        if fused is None:
            raise CannotFuse(", ".join(repr(p) for p in parts))
        return fused
    if any(type(p) is not nn.Linear for p in parts):
        raise CannotFuse(", ".join(repr(p) for p in parts))
    assert all(p.bias is None for p in parts) or all(p.bias is not None for p in parts)
    first = parts[0]
    fused = nn.Linear(first.in_features, sum(p.out_features for p in parts), bias=first.bias is not None)
    fused = fused.to(device=first.weight.device, dtype=first.weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if first.bias is not None:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused.requires_grad_(False)


def pack_linears(model: nn.Module, shared: set[int] | None = None, quantization: str | None = None) -> int:
    """Pack every CPU fp32 ``nn.Linear`` of ``model`` (and bf16 where `packable_dtypes` says so); returns how many were packed.

    Modules that can (``fuse_projections``: q/k/v, gate/up) first merge their projections into
    one linear. A weight that another module shares (tied embeddings) keeps its plain copy beside
    the packed one; any other weight is replaced by the packed tensor, so packing costs no memory.
    ``quantization="int8"`` quantizes every ``nn.Linear`` to int8 blocks of 32 instead
    (`layerzoo.layers.gguf_linear.quantize_linears_q8_0`).
    """
    shared = shared or set()
    if quantization == "int8":
        from layerzoo.layers.gguf_linear import quantize_linears_q8_0

        _fuse_projections(model, lambda p: p.dtype.is_floating_point)
        return quantize_linears_q8_0(model)
    assert quantization is None, quantization
    if not settings.flag(ENV) or not packing_available():
        return 0
    dtypes = packable_dtypes()
    _fuse_projections(model, lambda p: p.device.type == "cpu" and p.dtype in dtypes)
    count, misread = 0, []
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if type(module) is not nn.Linear or weight is None or weight.device.type != "cpu" or weight.dtype not in dtypes:
            continue
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        module.packed_weight = packed
        module.packed_address = torch.ops.mkldnn.data_ptr(packed)  # what the few-row kernel reads
        module.packed_bytes = torch.ops.mkldnn._nbytes(packed)
        if id(weight) not in shared:
            module.weight = nn.Parameter(packed, requires_grad=False)
        agrees = _packed_gemv_agrees(module)
        module.packed_gemv = bool(agrees)
        if agrees is False:
            misread.append(name)
        module.forward = types.MethodType(_packed_forward, module)
        count += 1
    if misread:
        log.info("few-row kernel: %d layer(s) keep oneDNN, their packed layout is not the one it reads "
                 "(a row multiplied both ways at load disagreed): %s", len(misread), ", ".join(misread[:5]))
    return count


def _fuse_projections(model: nn.Module, eligible) -> None:
    """Let modules that can (q/k/v, gate/up) merge their projections, where every weight is ``eligible``."""
    for module in list(model.modules()):
        fuse = getattr(module, "fuse_projections", None)
        weights = [p for p in module.parameters(recurse=False)] + [p for c in module.children() for p in c.parameters()]
        if fuse is not None and all(eligible(p) or p.dtype == torch.uint8 for p in weights):  # uint8: GGUF blocks
            try:
                fuse()
            except CannotFuse:
                pass  # e.g. q/k in Q4_K and v in Q6_K: three matmuls
