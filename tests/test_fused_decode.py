"""The fused CPU decode layer (`layerzoo.layers.fused_decode`): a plain Qwen3 layer's decode step runs
as one C++ call with the Python path's ops, so it generates bitwise what that path generates (the
same tokens and the same logprobs). Steps of short chunks (speculative verifies, short prompts)
take it too, each row a decode query of its own; steps it cannot take (more rows than its GEMVs
take, a chunk longer than the row queries serve) and layers it must not take run in Python."""

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.kernels import cpp_build
from layerzoo.layers import fused_decode, linear

AVX512 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
pytestmark = pytest.mark.skipif(not (AVX512 and linear.packing_available() and cpp_build.available()),
                                reason="needs the C++ kernels and oneDNN's packed AVX-512 layout")
NATIVE_BF16 = torch.bfloat16 in linear.packable_dtypes() and "avx512_bf16" in open("/proc/cpuinfo").read()

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 3, 5, 7, 2, 9, 4], [6] * 9, [13, 14]]


def layers(llm):
    return list(llm.engine.runner.model.layers)


def run(llm, prompts=PROMPTS, n=10, logprobs=2):
    params = SamplingParams(temperature=0, max_tokens=n, min_tokens=n, ignore_eos=True, logprobs=logprobs)
    out = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [(list(r.outputs[0].token_ids), r.outputs[0].logprobs) for r in out]


def fused_steps(llm) -> int:
    return sum(layer.__dict__["_decode_plan"].runs[0] for layer in layers(llm) if layer.__dict__.get("_decode_plan"))


@pytest.mark.parametrize("dtype, quantization", [
    ("float32", None),
    pytest.param("bfloat16", None, marks=pytest.mark.skipif(not NATIVE_BF16, reason="no AVX-512 BF16")),
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
    """A step with more rows than the GEMVs take runs the Python path; the fused call takes the
    others, a short prompt's step included."""
    llm = LLM(tiny_qwen3_dir, max_num_seqs=4, max_model_len=64)
    run(llm, prompts=[[1, 2]], n=4)  # one sequence: its 2-row prompt step and 3 decode steps, all fused
    plans = [layer.__dict__["_decode_plan"] for layer in layers(llm)]
    assert [p.runs for p in plans] == [[4, 5]] * len(plans)
    for p in plans:
        p.runs[:] = [0, 0]
    object.__setattr__(plans[0], "max_rows", 2)  # as if layer 0's GEMVs took two rows
    run(llm, prompts=[[1, 2, 3], [3, 4]], n=4)  # a 5-row prompt step, then 3 steps of two decode rows
    assert plans[0].runs == [3, 6] and all(p.runs == [4, 11] for p in plans[1:])

    for p in plans:
        p.runs[:] = [0, 0]
    rows = plans[1].max_rows
    run(llm, prompts=[list(range(1, rows + 2))], n=3)  # a prompt longer than the GEMVs take
    assert all(p.runs == [2, 2] for p in plans)


def test_speculative_verifies_fuse_and_verify_what_the_python_path_does(tiny_qwen3_dir, monkeypatch):
    """Verify steps (each sequence's last token and its drafts) run as row queries through the fused
    call; they accept what the Python path accepts, and generate what plain decoding does (requests
    that ask for logprobs do not speculate)."""
    from layerzoo.testing import ProposerPlugin, ScriptedProposer, registered_plugin

    prompts = [[5, 6, 7, 8] * 4, [9, 3, 9, 3, 9, 3, 9], [2, 4, 6, 2, 4, 6, 2]]
    plain = run(LLM(tiny_qwen3_dir, max_num_seqs=4, max_model_len=96), prompts=prompts, n=16, logprobs=None)
    # drafts from the plain outputs, every third with its last token wrong: verifies keep all, some, none
    expected = {tuple(p): tokens for p, (tokens, _) in zip(prompts, plain)}
    kwargs = dict(dtype="float32", max_num_seqs=4, max_model_len=96,
                  speculative_config={"method": "scripted", "num_speculative_tokens": 3, "adaptive": False})

    def spec_run(check=None):
        with registered_plugin(ProposerPlugin("scripted", ScriptedProposer(expected)), "scripted-proposer"):
            llm = LLM(tiny_qwen3_dir, **kwargs)
        if check is not None:
            check(llm)
        out = run(llm, prompts=prompts, n=16, logprobs=None)
        assert llm.stats.spec_verify_steps > 0
        return llm, out

    handed = []

    def spy_on(llm):
        pool = llm.engine.runner.kv
        real = pool.decode_operands

        def spy(layer, ctx):
            operands = real(layer, ctx)
            if operands is not None and layer == 0:
                handed.append((ctx.query_lens, ctx.context_lens))
            return operands

        monkeypatch.setattr(pool, "decode_operands", spy)

    fused, got = spec_run(spy_on)
    # a verify: sequences past their prompts with more than one new row (the last token and drafts)
    verifies = [q for q, c in handed if max(q) > 1 and all(n > len(p) for n, p in zip(c, prompts))]
    assert verifies and layers(fused)[0].__dict__["_decode_plan"].runs[0] == len(handed), handed

    monkeypatch.setenv(fused_decode.ENV, "0")
    python, want = spec_run()
    assert python.stats.spec_accepted_tokens == fused.stats.spec_accepted_tokens > 0
    assert got == want == plain


def test_a_layer_that_is_not_the_plain_one_keeps_the_python_path(tiny_qwen3_dir, caplog):
    from layerzoo.layers.mlp import GatedMLP

    class OwnMLP(GatedMLP):  # a plugin's MLP may change the math: the fused call must not assume it
        pass

    llm = LLM(tiny_qwen3_dir, max_num_seqs=4, max_model_len=64)
    first = layers(llm)[0]
    first.mlp.__class__ = OwnMLP
    with caplog.at_level("INFO", logger="layerzoo.layers.fused_decode"):
        run(llm, prompts=[[1, 2]], n=3)
    assert first.__dict__["_decode_plan"] is None
    assert "layer 0 (Qwen3DecoderLayer) runs op by op" in caplog.text and "OwnMLP is not the core's GatedMLP" in caplog.text
    assert layers(llm)[1].__dict__["_decode_plan"].runs[0] == 3  # the prompt's step and 2 decode steps
