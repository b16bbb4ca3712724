"""Decode graphs in a running engine on CPU (``compile_decode=True``: a ``torch.compile``'d decode
step per batch bucket is the captured artifact), end to end through the `LLM` API.

Each capability query that decode graphs consult changes what the engine does: a layer answering
``decode_graph_unsupported`` keeps decode eager (and says why); ``graph_stale_on_new_sequence``
decides whether a new sequence in a reused slot decodes through its own buffers or through a
stale graph's; ``fp8_calibration_frozen``, polled every step, keeps decode eager until the FP8 KV
scales freeze. Captured decode gives eager decode's greedy tokens, and a capture that fails falls
back to eager decoding with a log line.

Compiles are few (one per batch bucket and table width used) and on tiny models: keep it so.
"""

from __future__ import annotations

import logging

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.testing import (
    TestArchitecture,
    host_read_layer,
    registered_plugin,
    rename_architecture,
    sequence_buffer_layer,
)

pytest.importorskip("layerzoo_qwen3")

GRAPH_ARGS = dict(dtype="float32", max_num_seqs=4, max_model_len=256, compile_decode=True)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def tokens(llm, prompts, max_tokens=8) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens))
    return [o.outputs[0].token_ids for o in outs]


def capture_summary(llm) -> dict:
    return llm.engine.runner.decode_capture.summary()


PROMPTS = [[3, 14, 15, 9, 2, 6], [5, 35, 8, 9, 7, 9, 3, 2, 38, 4, 6], [2, 7, 18, 28]]


# -- captured decode gives eager decode's tokens ----------------------------------------------------


def test_captured_decode_matches_eager_on_the_embedded_model():
    """Three sequences decode in the bucket of four: one padded row, which writes only the KV
    scratch block and whose output never leaves."""
    eager = tokens(LLM(dtype="float32", max_model_len=256), PROMPTS, 10)
    llm = LLM(**GRAPH_ARGS)
    assert tokens(llm, PROMPTS, 10) == eager
    graphs = llm.stats.graphs
    assert graphs["eager"] == 0 and graphs["eager_reasons"] == {}
    assert graphs["replays"] == 9 and graphs["captures"] == 1  # 10 tokens: 1 from the prefill, 9 decodes
    assert capture_summary(llm) == {"artifacts": 1, "compiles": 1}  # one whole graph, compiled once
    assert llm.engine.kv.pad_block == llm.engine.blocks.num_blocks  # a block no sequence is given


def test_compile_is_opt_in_on_cpu_and_enforce_eager_means_eager(tiny_qwen3_dir):
    default = LLM(tiny_qwen3_dir, dtype="float32", max_model_len=64)
    tokens(default, PROMPTS[:1], 3)
    assert default.stats.graphs["eager_reasons"] == {"decode compile off on cpu (compile_decode=False)": 2}
    assert default.engine.runner.decode_capture is None
    default.engine.add_request("decoding", PROMPTS[0], greedy(8))
    for _ in range(3):  # the prompt, then decode steps: graphs off keep no graph slot for the sequence
        default.engine.step()
    assert default.engine.scheduler.running and default.engine.runner.slots.slot_of == {}
    forced = LLM(tiny_qwen3_dir, dtype="float32", max_model_len=64, compile_decode=True, enforce_eager=True)
    tokens(forced, PROMPTS[:1], 3)
    assert forced.stats.graphs["eager_reasons"] == {"graphs disabled by config": 2}


# -- decode_graph_unsupported, and a capture that fails ----------------------------------------------


def qwen3_variant(tmp_path_factory, src, arch: str):
    return rename_architecture(src, tmp_path_factory.mktemp(arch) / "model", arch)


@pytest.fixture(scope="module")
def host_read_dir(tmp_path_factory, tiny_qwen3_dir):
    return qwen3_variant(tmp_path_factory, tiny_qwen3_dir, "HostReadQwen3ForCausalLM")


def host_read_plugin(decode_graph_unsupported: bool) -> TestArchitecture:
    from layerzoo_qwen3.model import Qwen3DecoderLayer, Qwen3ForCausalLM

    return TestArchitecture(
        "HostReadQwen3ForCausalLM", Qwen3ForCausalLM, host_read_layer(Qwen3DecoderLayer),
        {"decode_graph_unsupported": decode_graph_unsupported},
    )


@pytest.fixture(scope="module")
def plain_tokens(tiny_qwen3_dir):
    return tokens(LLM(tiny_qwen3_dir, dtype="float32", max_model_len=256), PROMPTS)


def test_a_vetoed_layer_decodes_eagerly_and_is_named(host_read_dir, plain_tokens, caplog):
    with registered_plugin(host_read_plugin(True), "host-read-test"), caplog.at_level(logging.INFO):
        llm = LLM(host_read_dir, **GRAPH_ARGS)
        assert tokens(llm, PROMPTS) == plain_tokens
    reasons = llm.stats.graphs["eager_reasons"]
    (reason,) = reasons
    assert "layer 0 (HostReadLayer)" in reason and "decode_graph_unsupported" in reason
    assert reasons[reason] == 7 and llm.stats.graphs["replays"] == 0
    assert capture_summary(llm) == {"artifacts": 0, "compiles": 0}
    assert any(reason in r.getMessage() and "decoding eagerly" in r.getMessage() for r in caplog.records)


def test_a_capture_that_fails_falls_back_to_eager_with_a_log_line(host_read_dir, plain_tokens, caplog):
    """The same layer claiming its decode is graph-safe: compiling the step fails on its host
    read; the step and every later one decode eagerly, with the same tokens."""
    with registered_plugin(host_read_plugin(False), "host-read-test"), caplog.at_level(logging.WARNING):
        llm = LLM(host_read_dir, **GRAPH_ARGS)
        assert tokens(llm, PROMPTS) == plain_tokens
    graphs = llm.stats.graphs
    (reason,) = graphs["eager_reasons"]
    assert reason.startswith("decode graph capture failed (") and graphs["eager_reasons"][reason] == 7
    assert graphs["replays"] == 0 and graphs["graphs"] == 0
    assert [r.getMessage() for r in caplog.records if r.name == "layerzoo.runtime.graphs"] == [
        f"{reason}; decoding eagerly from now on"
    ]


# -- graph_stale_on_new_sequence -------------------------------------------------------------------

BUFFER_ARCH = "SequenceBufferQwen3ForCausalLM"


@pytest.fixture(scope="module")
def buffer_dir(tmp_path_factory, tiny_qwen3_dir):
    return qwen3_variant(tmp_path_factory, tiny_qwen3_dir, BUFFER_ARCH)


def buffer_plugin(stale: bool) -> TestArchitecture:
    from layerzoo_qwen3.model import Qwen3DecoderLayer, Qwen3ForCausalLM

    return TestArchitecture(
        BUFFER_ARCH, Qwen3ForCausalLM, sequence_buffer_layer(Qwen3DecoderLayer),
        {"uses_ssm_pool": False, "graph_stale_on_new_sequence": stale},
    )


def one_after_another(llm, prompts) -> list[list[int]]:
    """Each prompt alone, in turn: every one decodes in graph slot 0, freed by the one before."""
    return [tokens(llm, [p])[0] for p in prompts]


@pytest.fixture(scope="module")
def buffer_eager_tokens(buffer_dir):
    with registered_plugin(buffer_plugin(True), "buffer-test"):
        llm = LLM(buffer_dir, dtype="float32", max_model_len=256)
        assert llm.capabilities.own_state_layers == (0, 1)
        return one_after_another(llm, PROMPTS)


def test_graphs_of_a_reused_slot_are_dropped_when_they_go_stale(buffer_dir, buffer_eager_tokens):
    with registered_plugin(buffer_plugin(True), "buffer-test"):
        llm = LLM(buffer_dir, **GRAPH_ARGS)
        assert one_after_another(llm, PROMPTS) == buffer_eager_tokens
    graphs = llm.stats.graphs
    # each sequence recaptured slot 0's graph after the one before it dropped it on leaving
    assert graphs["captures"] == 3 and graphs["dropped"] == 3 and graphs["replays"] == 21 and graphs["eager"] == 0
    assert capture_summary(llm)["compiles"] == 1  # a new capture is a new static context, not a compile


def test_graphs_that_lie_about_going_stale_give_wrong_outputs(buffer_dir, buffer_eager_tokens):
    """Why the query exists: kept after its sequence left, the graph decodes the next sequence
    through the old sequence's (released) buffer."""
    with registered_plugin(buffer_plugin(False), "buffer-test"):
        llm = LLM(buffer_dir, **GRAPH_ARGS)
        outs = one_after_another(llm, PROMPTS)
    assert outs[0] == buffer_eager_tokens[0]  # the sequence the graph was captured with
    assert outs[1] != buffer_eager_tokens[1] and outs[2] != buffer_eager_tokens[2]
    assert llm.stats.graphs["captures"] == 1 and llm.stats.graphs["dropped"] == 0


# -- fp8_calibration_frozen, polled every step -------------------------------------------------------


def test_decode_stays_eager_while_fp8_calibrates_and_is_captured_after(tiny_qwen3_dir):
    """Calibration over the first 40 tokens of each layer: a 12-token prompt, then one token per
    step. Each step's route is checked against the layers' live state: removing the live poll
    (the build-time answers stand) lets a graph be captured mid-calibration and fails this."""
    window = 40
    fp8 = dict(kv_cache_dtype="fp8", fp8_calibration_tokens=window)
    prompt, steps = list(range(1, 13)), 40
    expected = tokens(LLM(tiny_qwen3_dir, dtype="float32", max_model_len=256, **fp8), [prompt], steps)[0]
    llm = LLM(tiny_qwen3_dir, **GRAPH_ARGS, **fp8)
    engine = llm.engine
    (seq,) = engine.add_request("r", prompt, greedy(steps))
    routes = []
    while engine.has_unfinished():
        calibrating = any(scales.calibrating for scales in engine.kv.fp8.values())
        before = dict(engine.runner.graphs.stats)
        engine.step()
        after = engine.runner.graphs.stats
        route = "graph" if after["replays"] > before["replays"] else "eager" if after["eager"] > before["eager"] else "prefill"
        routes.append((calibrating, route))
    assert seq.output_token_ids == expected
    # the prefill, then eager decodes while any layer calibrates, then graph replays only
    assert routes[0] == (True, "prefill")
    decodes = routes[1:]
    first_graph = next(i for i, (_, route) in enumerate(decodes) if route == "graph")
    assert all(cal and route == "eager" for cal, route in decodes[:first_graph])
    assert all(not cal and route == "graph" for cal, route in decodes[first_graph:])
    # the window closes with the write of token 40 (position 39): after the decode step feeding it
    assert first_graph == window - len(prompt)
    assert llm.stats.graphs["eager_reasons"] == {"fp8 calibration not frozen (layer 0)": first_graph}
    assert capture_summary(llm)["compiles"] == 1


# -- the C++ CPU ops inside a compiled step ------------------------------------------------------------


def test_a_compiled_cpu_step_calls_the_cpp_kernels(tiny_qwen3_dir):
    """The compiled step calls the few-row GEMV, paged decode attention and the norms as extern
    kernels (it used to trace the torch references: a gather of every table and oneDNN's GEMM),
    and decodes eager decoding's tokens."""
    from torch.profiler import ProfilerActivity, profile

    from layerzoo.kernels import cpp_build

    if not cpp_build.available():
        pytest.skip("the C++ kernels are not built here")
    args = dict(dtype="float32", max_num_seqs=4, max_model_len=256)
    eager = tokens(LLM(tiny_qwen3_dir, **args), PROMPTS, 8)
    llm = LLM(tiny_qwen3_dir, compile_decode=True, **args)
    tokens(llm, PROMPTS, 8)  # compiles
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        assert tokens(llm, PROMPTS, 8) == eager
    assert llm.stats.graphs["eager"] == 0 and capture_summary(llm)["compiles"] == 1
    calls = {event.key: event.count for event in prof.key_averages()}
    layers, decode_steps = len(llm.engine.model.layers), 7  # the prompts prefill eagerly, in one step
    assert calls.get("layerzoo_cpu::paged_decode_attention", 0) >= layers * decode_steps, calls
    assert calls.get("layerzoo_cpu::add_rms_norm", 0) >= 2 * layers * decode_steps, calls
    if llm.engine.model.layers[0].mlp.gate_up.packed_gemv:  # AVX-512 (oneDNN's layout the kernel reads)
        assert calls.get("layerzoo_cpu::packed_fp32_gemv", 0) >= 4 * layers * decode_steps, calls


# -- CUDA graphs (run by bench/gpu_check.sh on a machine with a GPU) ----------------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_decode_matches_eager_on_the_embedded_model(dtype):
    args = dict(dtype=dtype, device="cuda", max_num_seqs=4, max_model_len=256)
    eager = tokens(LLM(enforce_eager=True, **args), PROMPTS, 10)
    llm = LLM(**args)
    assert tokens(llm, PROMPTS, 10) == eager
    assert llm.stats.graphs["replays"] == 9 and llm.stats.graphs["eager"] == 0
    assert tokens(llm, PROMPTS[:1], 40) == tokens(LLM(enforce_eager=True, **args), PROMPTS[:1], 40)  # wider tables


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_honour_staleness(buffer_dir, buffer_eager_tokens):
    with registered_plugin(buffer_plugin(True), "buffer-test"):
        llm = LLM(buffer_dir, dtype="float32", device="cuda", max_num_seqs=4, max_model_len=256)
        assert one_after_another(llm, PROMPTS) == buffer_eager_tokens
    assert llm.stats.graphs["captures"] == 3 and llm.stats.graphs["eager"] == 0


# -- int8 linears inside a compiled step --------------------------------------------------------------


def test_int8_decode_compiles_and_matches_eager_int8(tiny_qwen3_dir):
    """The int8 (Q8_0 block) layers' GEMV is an extern op with registered shapes, so the whole step
    still compiles as one graph and decodes exactly what eager does."""
    args = dict(dtype="float32", max_model_len=256, quantization="int8")
    eager = [tokens(LLM(tiny_qwen3_dir, max_num_seqs=1, **args), [p], 8)[0] for p in PROMPTS]
    llm = LLM(tiny_qwen3_dir, max_num_seqs=1, compile_decode=True, **args)
    assert [tokens(llm, [p], 8)[0] for p in PROMPTS] == eager
    graphs = llm.stats.graphs
    assert graphs["eager"] == 0 and graphs["eager_reasons"] == {}, graphs
    assert capture_summary(llm) == {"artifacts": 1, "compiles": 1}
    batched = LLM(tiny_qwen3_dir, max_num_seqs=4, compile_decode=True, **args)
    tokens(batched, PROMPTS, 8)
    assert batched.stats.graphs["eager"] == 0 and capture_summary(batched)["compiles"] == 1
