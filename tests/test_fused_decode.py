"""The fused CPU decode layer (`layerzoo.layers.fused_decode`): a plain Qwen3 layer's decode step runs
as one C++ call with the Python path's ops, so it generates bitwise what that path generates (the
same tokens and the same logprobs); steps it cannot take (prompt rows in the step, more rows than
its GEMVs take) and layers it must not take run in Python."""

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.kernels import cpp_build
from layerzoo.layers import fused_decode, linear

AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
pytestmark = pytest.mark.skipif(not (AVX512 and linear.packing_available() and cpp_build.available()),
                                reason="needs the C++ kernels and oneDNN's packed AVX-512 layout")
BLOCKED_INT8 = linear.int8_blocked_available()
NATIVE_BF16 = torch.bfloat16 in linear.packable_dtypes() and "avx512_bf16" in open("/proc/cpuinfo").read()

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 3, 5, 7, 2, 9, 4], [6] * 9, [13, 14]]


def layers(llm):
    return list(llm.engine.runner.model.layers)


def run(llm, prompts=PROMPTS, n=10):
    params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True, logprobs=2)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(list(r.outputs[0].token_ids), r.outputs[0].logprobs) for r in out]


def fused_steps(llm) -> int:
    return sum(layer.__dict__["_decode_plan"].runs[0] for layer in layers(llm) if layer.__dict__.get("_decode_plan"))


@pytest.mark.parametrize("dtype, quantization", [
    ("float32", None),
    pytest.param("bfloat16", None, marks=pytest.mark.skipif(not NATIVE_BF16, reason="no AVX-512 BF16")),
    pytest.param("float32", "int8", marks=pytest.mark.skipif(not BLOCKED_INT8, reason="no blocked int8 GEMV (AVX-512 VNNI)")),
])
def test_fused_decode_generates_what_the_python_path_does(tiny_qwen3_dir, monkeypatch, dtype, quantization):
    kwargs = dict(dtype=dtype, quantization=quantization, max_num_seqs=4, max_model_len=64)
    fused = LLM(tiny_qwen3_dir, **kwargs)
    got = run(fused)
    # every decode step of every layer went through the C++ call (each of the 5 prompts decodes 9
    # tokens after its first; with 4 sequences at a time the steps hold 1-4 rows)
    assert fused_steps(fused) > 0
    assert all(layer.__dict__["_decode_plan"] is not None for layer in layers(fused))

    monkeypatch.setenv(fused_decode.ENV, "0")
    python = LLM(tiny_qwen3_dir, **kwargs)
    want = run(python)
    assert all(layer.__dict__["_decode_plan"] is None for layer in layers(python))
    assert got == want  # tokens and logprobs, bitwise


def test_steps_the_fused_call_cannot_take_run_in_python(tiny_qwen3_dir, monkeypatch):
    """A step with more decode rows than the GEMVs take, and a step with prompt rows, run the
    Python path; the fused call takes only the others."""
    llm = LLM(tiny_qwen3_dir, max_num_seqs=4, max_model_len=64)
    run(llm, prompts=[[1, 2]], n=4)  # one sequence: 3 decode steps, all fused
    plans = [layer.__dict__["_decode_plan"] for layer in layers(llm)]
    assert [p.runs[0] for p in plans] == [3] * len(plans)
    for p in plans:
        p.runs[0] = 0
    object.__setattr__(plans[0], "max_rows", 1)  # as if layer 0's GEMVs took one row
    run(llm, prompts=[[1, 2], [3, 4]], n=4)  # two rows a decode step
    assert plans[0].runs[0] == 0 and all(p.runs[0] == 3 for p in plans[1:])


def test_a_layer_that_is_not_the_plain_one_keeps_the_python_path(tiny_qwen3_dir):
    from layerzoo.layers.mlp import GatedMLP

    class OwnMLP(GatedMLP):  # a plugin's MLP may change the math: the fused call must not assume it
        pass

    llm = LLM(tiny_qwen3_dir, max_num_seqs=4, max_model_len=64)
    first = layers(llm)[0]
    first.mlp.__class__ = OwnMLP
    run(llm, prompts=[[1, 2]], n=3)
    assert first.__dict__["_decode_plan"] is None
    assert layers(llm)[1].__dict__["_decode_plan"].runs[0] == 2
