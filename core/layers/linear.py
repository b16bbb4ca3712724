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

import torch
from torch import nn

from layerzoo import settings
from layerzoo.layers.linear_method import FusedPart, LinearMethod

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


def packed_gemv(self: PackedLinear, flat: torch.Tensor) -> torch.Tensor:
    """``flat [M, K]`` (the layer's dtype) times the layer's oneDNN-packed weight, by the C++ few-row kernel."""
    return self.gemv_op(flat if flat.is_contiguous() else flat.contiguous(), self.packed_address, self.out_features,
                        self.in_features, self.gemv_bias, *self.gemv_layout)


def _bind_gemv(module: PackedLinear, block: int) -> None:
    """The layer's few-row kernel, bias, layout arguments and row limit, looked up once instead of on
    every call (blocks of 32 bf16 outputs are oneDNN's AMX layout: `AMX_BF16_GEMV_ROWS`)."""
    dtype = module.packed_weight.dtype
    module.gemv_rows = AMX_BF16_GEMV_ROWS if dtype == torch.bfloat16 and block == 32 else FP32_GEMV_ROWS
    module.gemv_op = getattr(torch.ops.layerzoo_cpu, _GEMV_OPS[dtype]).default
    module.gemv_bias = None if module.bias is None else module.bias.detach()
    module.gemv_layout = (module.packed_bytes,) if dtype == torch.float32 else (module.packed_bytes, block)


def _packed_gemv_agrees(module: PackedLinear) -> bool | None:
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


class PackedLinear(LinearMethod):
    """A dense fp32 or bf16 linear kept in oneDNN's packed layout (CPU): ``x [T, in] -> [T, out]``
    by the C++ few-row kernel that reads the packed buffer itself, up to ``gemv_rows`` rows where
    the layout check at load passed (``packed_gemv``), else by oneDNN's packed GEMM.

    ``weight`` is the packed tensor, or the plain one where another module shares it (tied
    embeddings: the packed copy is kept beside it in ``packed_weight``)."""

    # The fused decode call's last field: the block width of the layout the bf16 kernel reads
    # (fp32's kernel has one layout).
    _BLOCK_FIELD = {torch.float32: False, torch.bfloat16: True}

    def __init__(self, linear: nn.Linear, shared: bool):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), None)
        self.packed_weight = packed
        self.packed_address = torch.ops.mkldnn.data_ptr(packed)  # what the few-row kernel reads
        self.packed_bytes = torch.ops.mkldnn._nbytes(packed)
        self.weight = linear.weight if shared else nn.Parameter(packed, requires_grad=False)
        self.bias = linear.bias
        # True: the few-row kernel reads this layout; False: it misreads it (oneDNN keeps every
        # call); None: the kernel does not apply here (off, not built, no AVX-512).
        self.layout_check = _packed_gemv_agrees(self)
        self.packed_gemv = bool(self.layout_check)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
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

    def dequantized_weight(self) -> torch.Tensor:
        """``[out, in]``: the packed product of the identity (exact: each output is one weight)."""
        eye = torch.eye(self.in_features, dtype=self.packed_weight.dtype)
        with torch.no_grad():
            return torch.ops.mkldnn._linear_pointwise(eye, self.packed_weight, None, "none", [], "").t().contiguous()

    def fused_part(self) -> FusedPart | None:
        """By address, only where this linear's own forward would take the few-row kernel."""
        if not self.packed_gemv:
            return None
        dtype = self.packed_weight.dtype
        block = self.gemv_layout[1] if self._BLOCK_FIELD[dtype] else 0
        fields = (self.packed_address, self.out_features, self.in_features, self.gemv_layout[0], block)
        return FusedPart(fields, self.gemv_bias, (), self.gemv_rows, dtype)


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
    misread = []
    targets = [(name, module) for name, module in model.named_modules() if type(module) is nn.Linear
               and module.weight.device.type == "cpu" and module.weight.dtype in dtypes]
    for name, module in targets:
        assert name, "pack_linears replaces the linears inside a module, not the module itself"
        parent, _, attr = name.rpartition(".")
        packed = PackedLinear(module, shared=id(module.weight) in shared)
        setattr(model.get_submodule(parent), attr, packed)
        if packed.layout_check is False:
            misread.append(name)
    if misread:
        log.info("few-row kernel: %d layer(s) keep oneDNN, their packed layout is not the one it reads "
                 "(a row multiplied both ways at load disagreed): %s", len(misread), ", ".join(misread[:5]))
    return len(targets)


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
