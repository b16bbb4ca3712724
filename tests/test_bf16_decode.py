"""A bf16 engine on a CPU with native bf16: its decode steps run the C++ kernels (the few-row bf16
GEMV over oneDNN's packed weights, RMSNorm, rotary, SwiGLU, paged decode attention) instead of
falling back to torch, and generate what the oneDNN / torch path generates."""

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.kernels import cpp_build
from layerzoo.kernels.cpu_gemv import cpu
from layerzoo.layers import linear
from layerzoo.plugins.ops import kernel

NATIVE_BF16 = (linear.packing_available() and torch.bfloat16 in linear.packable_dtypes()
               and "avx512_bf16" in open("/proc/cpuinfo").read() and cpp_build.available())
pytestmark = pytest.mark.skipif(not NATIVE_BF16, reason="needs AVX-512 BF16, oneDNN bf16 packing and the C++ kernels")

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 3, 5, 7, 2, 9, 4]]
OPS = ("rms_norm", "rotary_embedding", "silu_and_mul", "paged_decode_attention", "paged_prefill_attention")


def generate(llm):
    params = SamplingParams(temperature=0, max_tokens=12, min_tokens=12, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def gemv_layers(llm):
    return [m for m in llm.engine.runner.model.modules() if getattr(m, "packed_gemv", None) is not None]


def test_bf16_decode_runs_the_cpp_kernels(tiny_qwen3_dir, monkeypatch):
    # the layers' Python path, whose GEMV routing this test flips (the fused decode layer, which runs
    # the same kernels in one call, has its own test: test_fused_decode.py)
    monkeypatch.setenv("LAYERZOO_FUSED_DECODE", "0")
    for op in OPS:
        kernel(op).fallbacks.clear()
    calls = []
    real = linear.packed_gemv
    monkeypatch.setattr(linear, "packed_gemv", lambda layer, flat: calls.append(flat.dtype) or real(layer, flat))
    llm = LLM(tiny_qwen3_dir, dtype="bfloat16", max_num_seqs=4, max_model_len=64)
    layers = gemv_layers(llm)
    assert layers and all(m.packed_gemv and m.packed_weight.dtype == torch.bfloat16 for m in layers)
    # each layer reads the layout this CPU packs (blocks of 32 outputs where it has AMX, else 64)
    assert {m.gemv_layout[1] for m in layers} == {cpu.bf16_packed_block()}
    with_kernel = generate(llm)
    assert calls and set(calls) == {torch.bfloat16}
    fallbacks = {op: kernel(op).fallbacks for op in OPS if kernel(op).fallbacks}
    assert not fallbacks, fallbacks  # before bf16 C++ ops: "fp32 only" for every one

    # The same engine with the kernel answer flipped to oneDNN's own bf16 GEMM: no kernel calls, the
    # same tokens (both round each product once to bf16 from fp32 sums).
    calls.clear()
    for m in layers:
        m.packed_gemv = False
    assert generate(llm) == with_kernel
    assert calls == []
