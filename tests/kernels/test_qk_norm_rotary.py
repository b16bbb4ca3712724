"""``qk_norm_rotary``: the C++ kernel is bitwise the separate C++ norm and rotary ops (fp32 and
bf16, partial rotary, with and without norm weights, strided slices of a fused qkv), close to the
plain-torch reference, and what an attention layer on CPU runs (the same tokens without it)."""

from __future__ import annotations

import shutil

import pytest
import torch

from layerzoo.errors import KernelUnsupported
from layerzoo.kernels import cpp_build
from layerzoo.kernels.qk_norm_rotary import cpp, reference
from layerzoo.kernels.rms_norm import cpp as norm_cpp
from layerzoo.kernels.rotary import cpp as rotary_cpp
from layerzoo.kernels.rotary.reference import cos_sin

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler: the kernel cannot be built here", allow_module_level=True)


@pytest.fixture(autouse=True, scope="module")
def _library_loaded():
    assert cpp_build.available(), cpp_build.why_unavailable()


def qkv_views(t, hq, hkv, d, r, dtype, seed):
    """q and k as strided views of one fused [T, (Hq + 2 Hkv) * D] projection, with cos/sin [T, R]."""
    g = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype)
    q, k, _ = qkv.split((hq * d, hkv * d, hkv * d), dim=-1)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, r, 2).float() / r))
    cos, sin = cos_sin(inv_freq, torch.arange(7, 7 + t), 1.0, dtype)
    weights = tuple((torch.rand(d, generator=g) + 0.5).to(dtype) for _ in range(2))
    return q.view(t, hq, d), k.view(t, hkv, d), weights, cos, sin


def separate(q, k, weights, eps, cos, sin):
    if weights is not None:
        q, k = norm_cpp.rms_norm(q, weights[0], eps)[0], norm_cpp.rms_norm(k, weights[1], eps)[0]
    return rotary_cpp.apply_rotary(q, cos, sin), rotary_cpp.apply_rotary(k, cos, sin)


CASES = [(1, 16, 8, 128, 128), (3, 4, 2, 64, 64), (5, 3, 1, 40, 24), (2, 2, 2, 17, 10), (9, 6, 3, 96, 32)]


@pytest.mark.parametrize("t,hq,hkv,d,r", CASES, ids=[f"T{c[0]}-Hq{c[1]}-Hkv{c[2]}-D{c[3]}-R{c[4]}" for c in CASES])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("normed", [True, False], ids=["norm", "no-norm"])
def test_bitwise_the_separate_ops_and_close_to_the_reference(t, hq, hkv, d, r, dtype, normed):
    q, k, weights, cos, sin = qkv_views(t, hq, hkv, d, r, dtype, seed=t * 100 + d + r)
    weights = weights if normed else None
    got = cpp.qk_norm_rotary(q, k, *(weights or (None, None)), 1e-6, cos, sin)
    want = separate(q, k, weights, 1e-6, cos, sin)
    ref = reference.qk_norm_rotary(q, k, *(weights or (None, None)), 1e-6, cos, sin)
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-5, rtol=1e-5)
    for g, w, e in zip(got, want, ref):
        assert g.shape == w.shape and g.is_contiguous()
        assert torch.equal(g, w)
        torch.testing.assert_close(g.float(), e.float(), **tol)


def test_refusals():
    q, k, weights, cos, sin = qkv_views(2, 4, 2, 32, 32, torch.float32, seed=1)
    with pytest.raises(KernelUnsupported):
        cpp.qk_norm_rotary(q.half(), k.half(), None, None, 1e-6, cos.half(), sin.half())
    with pytest.raises(KernelUnsupported):  # mixed dtypes go to the reference
        cpp.qk_norm_rotary(q, k, weights[0].bfloat16(), weights[1].bfloat16(), 1e-6, cos, sin)
    with pytest.raises(RuntimeError, match="both norm weights or neither"):
        torch.ops.layerzoo_cpu.qk_norm_rotary(q, k, weights[0], None, 1e-6, cos, sin)
    with pytest.raises(RuntimeError, match="R even and <= D"):
        torch.ops.layerzoo_cpu.qk_norm_rotary(q, k, None, None, 1e-6, cos[:, :5].contiguous(), sin[:, :5].contiguous())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_layers_run_it_on_cpu_and_generate_the_same_without_it(tiny_qwen3_dir, monkeypatch, dtype):
    """A Qwen3 engine on CPU calls the fused op once per layer and step; with the layer's answer
    flipped (the op reported as having no native kernel) it runs the separate ops instead and
    generates the same tokens."""
    from layerzoo import LLM, SamplingParams
    from layerzoo.plugins.kernel_registry import KernelOp
    from layerzoo.testing import generate_counting_ops

    llm = LLM(tiny_qwen3_dir, dtype=dtype, max_num_seqs=2, max_model_len=64)
    layers = llm.engine.runner.model.config.num_hidden_layers
    params = SamplingParams(temperature=0, max_tokens=6, min_tokens=6, ignore_eos=True)
    prompts = [{"prompt_token_ids": [3, 1, 4, 1, 5]}, {"prompt_token_ids": [9, 2, 6]}]

    def run():
        return generate_counting_ops(llm, prompts, params, "layerzoo_cpu::qk_norm_rotary", "layerzoo_cpu::rotary_embedding")

    fused, fused_calls, rotary_calls = run()
    assert fused_calls >= 6 * layers and rotary_calls == 0
    real = KernelOp.native
    monkeypatch.setattr(KernelOp, "native", lambda self, device: False if self.name == "qk_norm_rotary" else real(self, device))
    separate_out, fused_calls, rotary_calls = run()
    assert fused_calls == 0 and rotary_calls >= 2 * 6 * layers
    assert separate_out == fused
