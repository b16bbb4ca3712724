"""RMSNorm, rotary embedding and SwiGLU in Triton against their torch references: odd sizes,
partial rotary in both pair layouts, fused residual, strided inputs, fp32 and low-precision storage."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from layerzoo.kernels.rms_norm import reference as norm_ref
from layerzoo.kernels.rotary import reference as rope_ref
from layerzoo.kernels.silu_and_mul import reference as act_ref
from layerzoo.plugins.manager import PluginRegistry
from layerzoo.testing import assert_close

norm_tri = pytest.importorskip("layerzoo.kernels.rms_norm.triton")
rope_tri = pytest.importorskip("layerzoo.kernels.rotary.triton")
act_tri = pytest.importorskip("layerzoo.kernels.silu_and_mul.triton")

DTYPES = [
    pytest.param(torch.float32, 1e-6, id="fp32"),
    pytest.param(torch.float16, 1e-2, id="fp16"),
    pytest.param(torch.bfloat16, 1e-2, id="bf16"),
]
ROW_SHAPES = [(1, 1), (7, 3), (33, 65), (7, 127), (33, 1000)]
NORM_SHAPES = [pytest.param(T, D, id=f"T{T}-D{D}") for T, D in ROW_SHAPES]
# (T, H, D, R): R < D is partial rotary; D = 1 can only pass through (R must be even)
ROPE_SHAPES = [
    pytest.param(T, H, D, R, id=f"T{T}-H{H}-D{D}-R{R}")
    for T, H, D, R in [
        (1, 1, 1, 0), (7, 3, 3, 2), (33, 3, 65, 64), (7, 1, 127, 64), (1, 3, 127, 126), (7, 3, 1000, 1000)
    ]
]
LAYOUTS = [pytest.param(False, id="neox"), pytest.param(True, id="interleaved")]


def randn(*shape, dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def rope_cos_sin(T, R, dtype, device):
    """``cos, sin [T, R]`` as the model makes them, at positions past 0 so no angle is trivial."""
    inv_freq = 1.0 / (10000 ** (torch.arange(0, R, 2).float() / max(R, 1)))
    positions = torch.arange(T) * 3 + 5
    return (t.to(device) for t in rope_ref.cos_sin(inv_freq, positions, 1.0, dtype))


# -- rms_norm ----------------------------------------------------------------------------------


@pytest.mark.parametrize("residual", [pytest.param(False, id="plain"), pytest.param(True, id="residual")])
@pytest.mark.parametrize("T, D", NORM_SHAPES)
@pytest.mark.parametrize("dtype, ratio", DTYPES)
def test_rms_norm(T, D, residual, dtype, ratio, device, nan_empty):
    x = randn(T, D, dtype=dtype, device=device) * 3
    w = randn(D, dtype=dtype, device=device, seed=1)
    r = randn(T, D, dtype=dtype, device=device, seed=2) if residual else None
    ref_y, ref_r = norm_ref.rms_norm(x, w, 1e-6, r)
    y, r_out = norm_tri.rms_norm(x, w, 1e-6, r)
    assert y.dtype == ref_y.dtype and r_out.dtype == ref_r.dtype
    assert_close("y", ref_y, y, ratio)
    if residual:
        # one rounding of x + r in both: equal bit for bit
        assert torch.equal(r_out, ref_r)
    else:
        assert r_out is x


def test_rms_norm_leading_shape_strided_rows_and_mixed_dtypes(device, nan_empty):
    base = randn(2, 3, 2 * 65, dtype=torch.bfloat16, device=device)
    x = base[..., :65]  # strided rows
    r = randn(2, 3, 65, device=device, seed=1)  # fp32 residual: the sum is fp32, as in torch
    w = randn(65, device=device, seed=2)
    ref_y, ref_r = norm_ref.rms_norm(x, w, 1e-5, r)
    y, r_out = norm_tri.rms_norm(x, w, 1e-5, r)
    assert y.shape == ref_y.shape == (2, 3, 65) and y.dtype == ref_y.dtype == torch.float32
    assert_close("y", ref_y, y, 1e-6)
    assert_close("residual", ref_r, r_out, 1e-7)


def test_rms_norm_rejects_bad_inputs(device):
    x = randn(4, 8, device=device)
    with pytest.raises(ValueError, match="weight"):
        norm_tri.rms_norm(x, randn(7, device=device), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        norm_tri.rms_norm(x, randn(8, device=device), 1e-6, randn(4, 7, device=device))
    with pytest.raises(ValueError, match="dtype"):
        norm_tri.rms_norm(x.double(), randn(8, device=device), 1e-6)


# -- rotary_embedding --------------------------------------------------------------------------


@pytest.mark.parametrize("interleaved", LAYOUTS)
@pytest.mark.parametrize("T, H, D, R", ROPE_SHAPES)
@pytest.mark.parametrize("dtype, ratio", DTYPES)
def test_rotary(T, H, D, R, interleaved, dtype, ratio, device, nan_empty):
    x = randn(T, H, D, dtype=dtype, device=device)
    cos, sin = rope_cos_sin(T, R, dtype, device)
    ref = rope_ref.apply_rotary(x, cos, sin, interleaved)
    out = rope_tri.apply_rotary(x, cos, sin, interleaved)
    assert out.dtype == ref.dtype
    assert_close("out", ref, out, ratio)
    assert torch.equal(out[..., R:], x[..., R:])  # the pass-through part is copied


@pytest.mark.parametrize("interleaved", LAYOUTS)
def test_rotary_strided_heads_of_fused_qkv(interleaved, device, nan_empty):
    T, H, D = 7, 3, 16
    qkv = randn(T, 3 * H * D, device=device)
    q = qkv[:, H * D : 2 * H * D].view(T, H, D)  # token stride 3·H·D
    cos, sin = rope_cos_sin(T, 8, torch.float32, device)
    ref = rope_ref.apply_rotary(q, cos, sin, interleaved)
    assert_close("q", ref, rope_tri.apply_rotary(q, cos, sin, interleaved), 1e-6)


def test_interleaved_reference_is_complex_rotation():
    """GPT-J layout: pair (x[2i], x[2i+1]) as a complex number times exp(i·θᵢ), θᵢ from column i."""
    T, H, D, R = 5, 2, 12, 8
    x = randn(T, H, D).double()
    cos, sin = rope_cos_sin(T, R, torch.float64, "cpu")
    angle = torch.atan2(sin[:, : R // 2], cos[:, : R // 2])
    pairs = torch.view_as_complex(x[..., :R].reshape(T, H, R // 2, 2).contiguous())
    rotated = torch.view_as_real(pairs * torch.polar(torch.ones_like(angle), angle)[:, None]).flatten(-2)
    expected = torch.cat((rotated, x[..., R:]), dim=-1)
    torch.testing.assert_close(rope_ref.apply_rotary(x, cos, sin, interleaved=True), expected)


def test_rotary_rejects_bad_inputs(device):
    x = randn(4, 2, 8, device=device)
    cos, sin = rope_cos_sin(4, 8, torch.float32, device)
    with pytest.raises(ValueError, match="even"):
        rope_tri.apply_rotary(x, cos[:, :5], sin[:, :5])
    with pytest.raises(ValueError, match=r"\[T, R\]"):
        rope_tri.apply_rotary(x, cos[:3], sin[:3])
    with pytest.raises(ValueError, match=r"\[T, H, D\]"):
        rope_tri.apply_rotary(x[0], cos, sin)


# -- silu_and_mul ------------------------------------------------------------------------------


@pytest.mark.parametrize("T, I", [pytest.param(T, I, id=f"T{T}-I{I}") for T, I in ROW_SHAPES])
@pytest.mark.parametrize("dtype, ratio", DTYPES)
def test_silu_and_mul(T, I, dtype, ratio, device, nan_empty):
    gate_up = randn(T, 2 * I, dtype=dtype, device=device) * 4  # the halves of a fused projection
    gate, up = gate_up[:, :I], gate_up[:, I:]
    ref = act_ref.silu_and_mul(gate, up)
    out = act_tri.silu_and_mul(gate, up)
    assert out.dtype == ref.dtype
    assert_close("out", ref, out, ratio)


def test_silu_and_mul_rejects_bad_inputs(device):
    with pytest.raises(ValueError, match="same shape"):
        act_tri.silu_and_mul(randn(3, 4, device=device), randn(3, 5, device=device))
    with pytest.raises(ValueError, match="dtype"):
        act_tri.silu_and_mul(randn(3, 4, device=device).int(), randn(3, 4, device=device))


# -- registry ----------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["rms_norm", "rotary_embedding", "silu_and_mul"])
def test_registry_lists_triton_backend(op):
    registry = PluginRegistry(env={"LAYERZOO_PLUGINS": ""})
    registry.load()
    assert (op, "torch") in registry.kernels.entries
    assert (op, "triton") in registry.kernels.entries


# -- compiled, without a GPU -------------------------------------------------------------------

COMPILE_SCRIPT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from layerzoo.kernels.rms_norm.triton import rms_norm_fwd_kernel
from layerzoo.kernels.rotary.triton import rotary_fwd_kernel
from layerzoo.kernels.silu_and_mul.triton import silu_and_mul_fwd_kernel

def compile(kernel, signature, constexprs):
    while not isinstance(kernel, triton.runtime.jit.JITFunction):  # through heuristics, autotune
        kernel = kernel.fn
    signature = {name: signature.get(name, "constexpr") for name in kernel.arg_names}
    triton.compile(ASTSource(kernel, signature, constexprs), target=GPUTarget("cuda", 90, 32))

i32 = {"T": "i32", "stride_x": "i32", "stride_r": "i32", "stride_xt": "i32", "stride_xh": "i32",
       "stride_c": "i32", "stride_s": "i32", "I": "i32", "stride_g": "i32", "stride_u": "i32"}
compile(rms_norm_fwd_kernel,
        dict(i32, x="*bf16", weight="*fp32", residual="*bf16", y="*fp32", residual_out="*bf16", eps="fp32"),
        dict(D=1000, BD=1024, BT=4, HAS_RESIDUAL=True))
compile(rms_norm_fwd_kernel, dict(i32, x="*fp16", weight="*fp16", y="*fp16", eps="fp32"),
        dict(residual=None, residual_out=None, D=65, BD=128, BT=1, HAS_RESIDUAL=False))
for interleaved in (False, True):
    compile(rotary_fwd_kernel, dict(i32, x="*bf16", cos="*bf16", sin="*bf16", y="*bf16"),
            dict(H=3, D=127, R=64, BH=4, BD=128, INTERLEAVED=interleaved))
compile(silu_and_mul_fwd_kernel, dict(i32, gate="*bf16", up="*bf16", out="*bf16"), dict(BI=1024))
"""


def test_kernels_compile_for_sm90():
    """The interpreter accepts code the compiler rejects: build every kernel variant down to a
    cubin for an H100-class target, which needs no GPU (a fresh process: the interpreter is off)."""
    from triton.backends import backends

    if "nvidia" not in backends:
        pytest.skip("triton has no nvidia backend here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT], env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
