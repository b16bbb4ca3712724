"""FP8 (e4m3) KV-cache quantisation as Triton kernels; same signatures as ``reference.py``.

Both kernels are elementwise over the flattened tensor and read the scale from its device tensor
(no host read, so a captured graph sees the scale's value at replay). The fp32 → e4m3 cast rounds
to nearest even, saturating at ±448 after the explicit clamp, as torch's cast does.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from layerzoo.kernels.fp8_kv import reference

FP8_DTYPE = reference.FP8_DTYPE
FP8_MAX = reference.FP8_MAX
BLOCK = 1024


@triton.jit
def _quantize_kernel(x_ptr, scale_ptr, out_ptr, n, FP8_MAX: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    y = tl.math.div_rn(x, tl.load(scale_ptr))  # correctly rounded, as torch divides
    y = tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX)
    # The output's dtype decides the cast: e4m3 for the cache, fp32 for the scaled values alone.
    tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequantize_kernel(x_ptr, scale_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, (x * tl.load(scale_ptr)).to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _sm89_or_newer(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device) >= (8, 9)


def _native_fp8(t: torch.Tensor) -> bool:
    """Triton's e4m3 type needs sm_89+ on CUDA (older GPUs run the reference); the interpreter
    (CPU tensors) always has it."""
    return not t.is_cuda or _sm89_or_newer(t.device)


def _scale_of(scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    assert scale.numel() == 1 and scale.dtype == torch.float32, "scale: a 0-d fp32 tensor"
    assert scale.device == like.device, f"scale on {scale.device}, values on {like.device}"
    return scale


def quantize_into(x: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out = cast(clamp(x / scale, ±448))`` with ``out``'s dtype: e4m3, or fp32 for the scaled
    values alone (the interpreter's fp32 → fp8 cast is unreliable, so CPU tests check these)."""
    x = x.contiguous()
    assert out.shape == x.shape and out.is_contiguous()
    n = x.numel()
    if n:
        _quantize_kernel[(triton.cdiv(n, BLOCK),)](x, _scale_of(scale, x), out, n, FP8_MAX=FP8_MAX, BLOCK=BLOCK)
    return out


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [T, H, D]`` float → ``float8_e4m3fn`` ``[T, H, D]``: ``x / scale`` clamped to ±448."""
    if not _native_fp8(x):
        return reference.quantize_fp8(x, scale)
    return quantize_into(x, scale, torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device))


def dequantize_fp8(x8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``float8_e4m3fn`` of any shape → ``x8.float() * scale`` in ``dtype``."""
    if not _native_fp8(x8):
        return reference.dequantize_fp8(x8, scale, dtype)
    x8 = x8.contiguous()
    out = torch.empty(x8.shape, dtype=dtype, device=x8.device)
    n = x8.numel()
    if n:
        _dequantize_kernel[(triton.cdiv(n, BLOCK),)](x8, _scale_of(scale, x8), out, n, BLOCK=BLOCK)
    return out
