"""CPU weight packing for linear layers, prepared once at load: oneDNN's blocked fp32 layout, or
int8 weights with per-channel scales (``quantization="int8"``).

MKL's sgemm repacks the weight on every call, which costs more than the matmul itself when only a
few rows are multiplied (decode): measured here, a prepacked oneDNN linear reads weights ~2x
faster at 1–32 rows and is ~1.2x faster at 1000. Packing happens after the strict load, on CPU
fp32 weights (and bf16 ones on a CPU with native bf16, `packable_dtypes`);
``LAYERZOO_CPU_PACKED_LINEAR=0`` turns it off.

int8: each weight row (output channel) gets the scale ``max|w_row| / 127`` and is rounded to int8;
the product runs in fbgemm through torch (``torch.ops.quantized.linear_dynamic``): the activations
``[T, K]`` are quantized to uint8 on the fly (one scale per call), multiplied in int8 with AVX2
``vpmaddubsw`` (or VNNI) and rescaled to fp32. Decode reads a quarter of the fp32 bytes. Measured
on an AVX2 machine (bench/linear_kernels.py), it beats the fp32 oneDNN linear at every row count, while
torch's weight-only ``_weight_int8pack_mm`` and ``_int_mm`` take scalar fallbacks there (10-100x
slower than fp32). Activations use 7 bits (``reduce_range``): without VNNI, ``vpmaddubsw`` sums two
u8 x s8 products into int16, which 8-bit activations could overflow. Decode calls (few rows) run
the C++ GEMV of ``layerzoo.kernels.cpu_gemv`` instead where it is built (`INT8_GEMV_ROWS`).
"""

from __future__ import annotations

import itertools
import logging
import os
import types
import warnings
import weakref

import torch
from torch import nn

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
FP32_GEMV_ROWS = min(int(os.environ.get("LAYERZOO_FP32_GEMV_ROWS", "32")), FP32_GEMV_MAX_ROWS)
# Where the CPU has AMX, oneDNN multiplies bf16 with its tiles (and packs AB16b32a2b): on an Intel
# Xeon (2 threads, 0.6B shapes, in turns) the bf16 kernel streamed 1.04-1.17x as fast at 1-4 rows,
# 0.89x at 8, 0.54x at 16, 0.35x at 32, so from 5 rows such a layer keeps oneDNN.
AMX_BF16_GEMV_ROWS = min(int(os.environ.get("LAYERZOO_AMX_BF16_GEMV_ROWS", "4")), FP32_GEMV_ROWS)

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


def fuse_linears(parts: list[nn.Linear]) -> nn.Linear:
    """One linear whose output is the parts' outputs side by side (weights concatenated by rows)."""
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
    ``quantization="int8"`` quantizes every ``nn.Linear`` instead (any float dtype, CPU only).
    """
    shared = shared or set()
    if quantization == "int8":
        _fuse_projections(model, lambda p: p.device.type == "cpu" and p.dtype.is_floating_point)
        return quantize_linears_int8(model, shared)
    assert quantization is None, quantization
    if os.environ.get(ENV, "1") == "0" or not packing_available():
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
        if fuse is not None and all(eligible(p) for p in weights):
            fuse()


# -- int8 -----------------------------------------------------------------------------------------

# 7-bit activations: see the module docstring (int16 accumulation of vpmaddubsw without VNNI).
INT8_REDUCE_RANGE = True


def int8_available() -> bool:
    return "fbgemm" in torch.backends.quantized.supported_engines


def quantize_per_channel_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [N, K]`` → (int8 ``[N, K]``, fp32 scales ``[N]``) with ``weight ≈ q * scale[:, None]``.

    Symmetric, one scale per output channel: ``max|w_row| / 127`` (an all-zero row gets scale 1).
    """
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / 127.0, torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def prepack_int8(q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None):
    """fbgemm's packed form of int8 weights ``q [N, K]`` with per-channel ``scale [N]`` (+ fp32 bias)."""
    with warnings.catch_warnings():
        # torch 2.13 deprecates creating qint8 tensors (pytorch#184982); linear_prepack still takes
        # only those. The packed weights and linear_dynamic carry no warning.
        warnings.filterwarnings("ignore", message=".*quantized tensor creation functions.*")
        qweight = torch._make_per_channel_quantized_tensor(q, scale.double(), torch.zeros_like(scale, dtype=torch.long), 0)
    previous = torch.backends.quantized.engine
    torch.backends.quantized.engine = "fbgemm"
    try:
        return torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float())
    finally:
        torch.backends.quantized.engine = previous


def int8_linear(x: torch.Tensor, packed) -> torch.Tensor:
    """``x [..., K]`` (any float dtype) times packed int8 weights → ``[..., N]`` in ``x``'s dtype."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    if flat.dtype != torch.float32:
        flat = flat.float()
    out = torch.ops.quantized.linear_dynamic(flat.contiguous(), packed, INT8_REDUCE_RANGE)
    return out.reshape(*shape[:-1], out.shape[-1]).to(x.dtype)


# From this many rows on (prefill chunks) an int8 linear may multiply in fp32 by weights dequantized
# on the fly (see `_int8_forward`); 0, the default, sends every call through fbgemm. Measured here
# (bench/linear_kernels.py, AVX2, 2 threads, M=1024, Qwen3-0.6B shapes) fbgemm's int8 GEMM is
# 1.6-1.9x the fp32 one, so the fp32 route trades that speed for per-row exact activations:
# opt in with LAYERZOO_INT8_DEQUANT_ROWS=128 where accuracy of long batched chunks matters more.
INT8_DEQUANT_ROWS = int(os.environ.get("LAYERZOO_INT8_DEQUANT_ROWS", "0"))


def dequantized_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K]`` times the int8 weights ``q [N, K]`` dequantized (``q * scale[:, None]``) in fp32."""
    weight = q.to(torch.float32).mul_(scale[:, None])
    out = torch.nn.functional.linear(x.to(torch.float32), weight, None if bias is None else bias.float())
    return out.to(x.dtype)


# fbgemm's packed weights are a TorchScript object, which dynamo cannot pass to an op in a traced
# graph: a compiled decode step (layerzoo.runtime.decode_capture) calls `int8_linear_op` with the
# layer's key instead, and the op finds the layer's packed weights here.
_int8_layers: dict[int, weakref.ref] = {}
_int8_keys = itertools.count()


@torch.library.custom_op("layerzoo::int8_linear", mutates_args=())
def int8_linear_op(x: torch.Tensor, key: int, out_features: int) -> torch.Tensor:
    """`int8_linear` of ``x [..., K]`` by the packed weights of the int8 layer registered as ``key``."""
    layer = _int8_layers[key]()
    assert layer is not None, f"int8 layer {key} was freed while a compiled step still calls it"
    return int8_linear(x, layer.int8_packed)


@int8_linear_op.register_fake
def _int8_linear_shape(x, key, out_features):
    return x.new_empty(*x.shape[:-1], out_features)


# Up to this many rows (decode steps, short verifies) an int8 linear runs the C++ GEMV
# (layerzoo.kernels.cpu_gemv) where it is built: it streams the int8 weights once at memory speed
# and quantizes each activation row with its own scale (fbgemm uses one scale per call, so a decode
# row's rounding depended on its batch). With AVX-512 VNNI the weights are kept blocked for it
# (`blocked_int8_gemv`, no second copy); from 9 rows on fbgemm's int8 GEMM multiplies faster. The
# row-major GEMV elsewhere loses to fbgemm from 3 rows.
INT8_GEMV_ROWS = int(os.environ.get("LAYERZOO_INT8_GEMV_ROWS", "2"))
INT8_BLOCKED_GEMV_ROWS = int(os.environ.get("LAYERZOO_INT8_BLOCKED_GEMV_ROWS", "8"))


def int8_gemv_available() -> bool:
    from layerzoo.kernels.cpu_gemv import cpu

    return cpu.available()


def int8_blocked_available() -> bool:
    """Whether the blocked int8 GEMV runs here (built, with AVX-512 VNNI): one call on a tiny layer."""
    from layerzoo.kernels.cpu_gemv import cpu

    if not cpu.available():
        return False
    w, colsum = cpu.block_int8(torch.ones(1, 1, dtype=torch.int8))
    try:
        cpu.blocked_int8_gemv(torch.ones(1, 1), w, colsum, torch.ones(1), None)
    except RuntimeError:  # built without AVX-512 VNNI
        return False
    return True


def int8_weight_rows(module: nn.Linear) -> torch.Tensor:
    """The int8 layer's weights as ``[N, K]`` rows (a copy where they are kept blocked)."""
    if module.int8_colsum is None:
        return module.int8_weight
    from layerzoo.kernels.cpu_gemv import cpu

    return cpu.unblock_int8(module.int8_weight, module.out_features, module.in_features)


def _int8_gemv(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    # A decode step's fp32 [T, K] rows go as they are: the reshapes and casts cost ~4 us a call.
    flat = x if x.dim() == 2 else x.reshape(-1, x.shape[-1])
    flat = flat.float().contiguous()  # no-ops for those rows
    if self.int8_colsum is not None:
        out = torch.ops.layerzoo_cpu.blocked_int8_gemv.default(flat, self.int8_weight, self.int8_colsum, self.weight_scale,
                                                                self.int8_bias)
    else:
        out = torch.ops.layerzoo_cpu.int8_gemv.default(flat, self.int8_weight, self.weight_scale, self.int8_bias)
    if flat is x:
        return out
    return out.reshape(*x.shape[:-1], out.shape[-1]).to(x.dtype)


def _int8_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """Few rows: the C++ GEMV where it is built (see ``INT8_GEMV_ROWS``). Otherwise
    fbgemm's int8 GEMM (a quarter of fp32's bytes; faster than fp32 at every row count here),
    unless ``INT8_DEQUANT_ROWS`` routes many-row calls to an fp32 product by the dequantized weight:
    compute-bound, so dequantizing costs little next to it, and every row's activations stay exact
    (fbgemm quantizes all rows of a call with one scale, so in a long batched chunk one row's
    outliers cost every other row, and other requests, precision)."""
    rows = x.shape[0] if x.dim() == 2 else x.numel() // x.shape[-1] if x.shape[-1] else 0
    if self.int8_gemv and 0 < rows <= self.int8_gemv_rows:
        return _int8_gemv(self, x)
    if torch.compiler.is_compiling():  # a compiled decode step without the GEMV: fbgemm by key
        return int8_linear_op(x, self.int8_key, self.out_features)
    if INT8_DEQUANT_ROWS and rows >= INT8_DEQUANT_ROWS:
        return dequantized_linear(x, int8_weight_rows(self), self.weight_scale, self.bias)
    return int8_linear(x, self.int8_packed)


def quantize_linears_int8(model: nn.Module, shared: set[int]) -> int:
    """Quantize every ``nn.Linear`` of ``model`` to int8 (per-channel); returns how many.

    Each module keeps ``weight`` as its int8 tensor (so that its bytes are what it holds):
    ``[N, K]``, or blocked for the GEMV where AVX-512 VNNI runs it (`int8_weight_rows` gives the
    rows back); ``weight_scale [N]`` and ``int8_packed`` (fbgemm's layout, for many rows). A weight
    another module shares (a tied embedding) stays as it is for that module.
    """
    from layerzoo.errors import UserError

    if not int8_available():
        raise UserError(f"quantization='int8': this torch build has no fbgemm quantized engine "
                        f"(engines: {torch.backends.quantized.supported_engines})")
    gemv = INT8_GEMV_ROWS > 0 and int8_gemv_available()
    blocked = gemv and INT8_BLOCKED_GEMV_ROWS > 0 and int8_blocked_available()
    count = 0
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        weight = module.weight
        if weight.device.type != "cpu":
            raise UserError(f"quantization='int8' runs on CPU only; layer {name!r} is on {weight.device}")
        q, scale = quantize_per_channel_int8(weight)
        module.int8_packed = prepack_int8(q, scale, module.bias)
        module.int8_key = next(_int8_keys)
        _int8_layers[module.int8_key] = weakref.ref(module, lambda _, key=module.int8_key: _int8_layers.pop(key, None))
        module.register_buffer("weight_scale", scale, persistent=False)
        module.int8_colsum = None
        if blocked:
            from layerzoo.kernels.cpu_gemv import cpu

            q, module.int8_colsum = cpu.block_int8(q)  # fbgemm has packed its own copy already
        module.int8_weight = q  # the same tensor as ``weight`` unless that is shared
        module.int8_bias = None if module.bias is None else module.bias.detach().float().contiguous()
        module.int8_gemv = gemv
        module.int8_gemv_rows = INT8_BLOCKED_GEMV_ROWS if blocked else INT8_GEMV_ROWS
        if id(weight) not in shared:
            module.weight = nn.Parameter(q, requires_grad=False)
        module.forward = types.MethodType(_int8_forward, module)
        count += 1
    return count
