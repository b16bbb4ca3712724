"""The FP8 (e4m3) KV cache end to end: pool sizing, quantised attention, online calibration (the
window, the freeze in place, the rewrite of staged entries), the ``fp8_calibration_frozen`` answers
and the graph gate, checkpoint scales, and accuracy against an fp32 cache on a tiny Qwen3."""

import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from layerzoo import LLM, SamplingParams
from layerzoo.engine_args import EngineArgs
from layerzoo.errors import UserError
from layerzoo.layers.context import ForwardContext
from layerzoo.layers.kv_cache import KVCacheSpec
from layerzoo.loading.model_loading import load_model
from layerzoo.plugins.capabilities import ModelCapabilities, first_answer
from layerzoo.runtime.fp8_calibration import HEADROOM, PROVISIONAL_MARGIN
from layerzoo.runtime.kv_pool import PagedKVCache, num_blocks_for_budget, with_kv_cache_dtype

FP8 = torch.float8_e4m3fn
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def fake_quant(x, scale):
    """``x`` rounded through e4m3 at ``scale``: what an FP8 cache gives back."""
    return ((x.float() / scale).clamp(-448, 448).to(FP8).float() * scale).to(x.dtype)


def gate_open(model) -> bool:
    return ModelCapabilities.graphs_ready_after_fp8_calibration(model.fp8_calibration_states())


# -- kv_cache_dtype and sizing ------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["int4", "fp8_e5m2", "", None, 8])
def test_bad_kv_cache_dtype_is_a_user_error(bad):
    with pytest.raises(UserError, match="kv_cache_dtype"):
        EngineArgs(kv_cache_dtype=bad)


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_calibration_tokens_is_a_user_error(bad):
    with pytest.raises(UserError, match="fp8_calibration_tokens"):
        EngineArgs(kv_cache_dtype="fp8", fp8_calibration_tokens=bad)


def test_llm_rejects_a_bad_kv_cache_dtype(tiny_qwen3_dir):
    with pytest.raises(UserError, match="kv_cache_dtype"):
        LLM(tiny_qwen3_dir, kv_cache_dtype="fp4")


@pytest.mark.parametrize("dtype, ratio", [(torch.float32, 4), (torch.float16, 2), (torch.bfloat16, 2)])
def test_fp8_halves_or_quarters_bytes_per_token(dtype, ratio):
    specs = {0: KVCacheSpec(2, 8, dtype), 3: KVCacheSpec(4, 16, dtype)}
    fp8 = with_kv_cache_dtype(specs, "fp8_e4m3")
    assert with_kv_cache_dtype(specs, "auto") == specs
    assert all(s.cache_dtype == FP8 and s.dtype == dtype for s in fp8.values())
    per_token = sum(s.bytes_per_token for s in specs.values())
    assert sum(s.bytes_per_token for s in fp8.values()) * ratio == per_token
    assert sum(s.bytes_per_token for s in fp8.values()) == 2 * (2 * 8 + 4 * 16)  # one byte per element
    budget = 10 * 16 * per_token  # ten blocks of the wide cache
    assert num_blocks_for_budget(fp8, 16, budget) == ratio * num_blocks_for_budget(specs, 16, budget) == ratio * 10
    wide, narrow = PagedKVCache(specs, 3, 16), PagedKVCache(fp8, 3, 16)
    assert wide.nbytes == ratio * narrow.nbytes
    assert narrow.k[3].dtype == FP8 and not wide.fp8


def test_engine_fits_four_times_the_blocks(tiny_qwen3_dir):
    budget = 64 * 16 * 2 * 2 * 2 * 8 * 4  # 64 fp32 blocks of 16 tokens (2 layers, 2 KV heads, D=8)
    wide = LLM(tiny_qwen3_dir, dtype="float32", kv_cache_memory=budget, max_model_len=1024)
    narrow = LLM(tiny_qwen3_dir, dtype="float32", kv_cache_memory=budget, kv_cache_dtype="fp8", max_model_len=1024)
    assert wide.engine.blocks.num_blocks == 64
    assert narrow.engine.blocks.num_blocks == 4 * 64
    assert narrow.engine.kv.nbytes == wide.engine.kv.nbytes


# -- the pool: quantised writes, dequantised attention, calibration -----------------------------


SPECS = {0: KVCacheSpec(2, 8, torch.float32)}
BS = 4


def step_ctx(kv, query_lens, context_lens, tables, num_decodes):
    return ForwardContext.for_paged(
        seq_ids=list(range(len(query_lens))), query_lens=query_lens, context_lens=context_lens,
        block_tables=tables, block_size=BS, num_decodes=num_decodes, kv_cache=kv,
    )


def random_steps(seed=0):
    """Two sequences: a prefill of 5 and 7 tokens, then three batched decode steps."""
    g = torch.Generator().manual_seed(seed)
    tables = [[3, 1, 6], [0, 5, 2, 4]]

    def qkv(t):
        return (torch.randn(t, 4, 8, generator=g), torch.randn(t, 2, 8, generator=g) * 3,
                torch.randn(t, 2, 8, generator=g) * 0.2)

    steps = [((5, 7), (5, 7), 0)] + [((1, 1), (5 + i, 7 + i), 2) for i in range(1, 4)]
    return [(query, context, tables, nd, qkv(sum(query))) for query, context, nd in steps]


def run_steps(kv, steps, transform=None):
    outs = []
    for query, context, tables, nd, (q, k, v) in steps:
        if transform is not None:
            k, v = transform(k, v)
        outs.append(kv.attend(0, q, k, v, 8**-0.5, step_ctx(kv, list(query), list(context), tables, nd)))
    return outs


def test_fp8_attention_is_fp32_attention_over_rounded_kv():
    """Once frozen, the FP8 pool attends exactly as an fp32 pool over e4m3-rounded K/V."""
    steps = random_steps()
    fp8 = PagedKVCache(with_kv_cache_dtype(SPECS, "fp8"), 8, BS, fp8_calibration_tokens=12)
    got = run_steps(fp8, steps)
    scales = fp8.fp8[0]
    assert scales.calibration_frozen is True  # 12 tokens in the first step
    ks, vs = scales.k_scale, scales.v_scale
    want = run_steps(PagedKVCache(SPECS, 8, BS), steps, lambda k, v: (fake_quant(k, ks), fake_quant(v, vs)))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    exact = run_steps(PagedKVCache(SPECS, 8, BS), steps)
    assert max((a - b).abs().max() for a, b in zip(got, exact)) < 0.1  # and close to unrounded


def test_calibration_window_provisional_then_frozen_in_place():
    steps = random_steps(seed=1)
    fp8 = PagedKVCache(with_kv_cache_dtype(SPECS, "fp8"), 8, BS, fp8_calibration_tokens=14)
    scales = fp8.fp8[0]
    k_scale, v_scale = scales.k_scale, scales.v_scale
    ptr = k_scale.data_ptr()
    assert scales.calibration_frozen is False and float(k_scale) == 1.0
    (_, _, _, _, (q0, k0, v0)), (_, _, _, _, (q1, k1, v1)) = steps[:2]

    run_steps(fp8, steps[:1])  # 12 tokens: still calibrating, at the provisional scale
    assert scales.calibration_frozen is False
    assert float(k_scale) == pytest.approx(float(k0.abs().max()) * PROVISIONAL_MARGIN / 448)
    assert float(v_scale) == pytest.approx(float(v0.abs().max()) * PROVISIONAL_MARGIN / 448)
    provisional = float(k_scale)

    run_steps(fp8, steps[1:2])  # 14 tokens: the window ends, the scales freeze
    assert scales.calibration_frozen is True
    assert fp8.fp8[0].k_scale is k_scale and k_scale.data_ptr() == ptr  # the same tensor, updated in place
    k_amax = max(float(k0.abs().max()), float(k1.abs().max()))
    assert float(k_scale) == pytest.approx(k_amax * HEADROOM / 448) and float(k_scale) != provisional
    # The staged window was rewritten at the frozen scale: every slot holds its token at it.
    ctx0 = step_ctx(fp8, [5, 7], [5, 7], steps[0][2], 0)
    ctx1 = step_ctx(fp8, [1, 1], [6, 8], steps[0][2], 2)
    flat = fp8.k[0].view(-1, 2, 8)
    for ctx, k in ((ctx0, k0), (ctx1, k1)):
        stored = flat.view(torch.uint8)[ctx.slot_mapping].view(FP8).float() * k_scale
        torch.testing.assert_close(stored, fake_quant(k, k_scale), rtol=0, atol=0)

    frozen = float(k_scale)
    run_steps(fp8, steps[2:])  # never changes again, whatever comes
    assert float(k_scale) == frozen and scales.calibrator.seen == 14


def test_a_slot_rewritten_inside_the_window_keeps_its_last_token():
    """Rollback/preemption/free can write a slot twice in the window; the rewrite keeps the last."""
    fp8 = PagedKVCache(with_kv_cache_dtype(SPECS, "fp8"), 4, BS, fp8_calibration_tokens=6)
    g = torch.Generator().manual_seed(2)
    first, second = torch.randn(4, 2, 8, generator=g), torch.randn(4, 2, 8, generator=g) * 5
    for k in (first, second):  # the same 4 positions of one sequence, twice
        ctx = step_ctx(fp8, [4], [4], [[1, 2]], 0)
        fp8.attend(0, torch.randn(4, 4, 8, generator=g), k, k, 1.0, ctx)
    assert fp8.fp8[0].calibration_frozen is True
    stored = fp8.k[0].view(-1, 2, 8).view(torch.uint8)[ctx.slot_mapping].view(FP8).float() * fp8.fp8[0].k_scale
    torch.testing.assert_close(stored, fake_quant(second, fp8.fp8[0].k_scale), rtol=0, atol=0)


def test_zero_calibration_tokens_means_a_fixed_scale():
    fp8 = PagedKVCache(with_kv_cache_dtype(SPECS, "fp8"), 8, BS, fp8_calibration_tokens=0)
    run_steps(fp8, random_steps())
    assert fp8.fp8[0].calibration_frozen is None and fp8.fp8[0].source == "fixed"
    assert float(fp8.fp8[0].k_scale) == 1.0


# -- the model: answers, the gate, accuracy -----------------------------------------------------


def test_layers_answer_while_calibrating_and_the_gate_opens_after_n_tokens(tiny_qwen3_dir):
    window = 20
    llm = LLM(tiny_qwen3_dir, dtype="float32", kv_cache_dtype="fp8_e4m3", fp8_calibration_tokens=window)
    engine, model = llm.engine, llm.loaded.model
    scales = [engine.kv.fp8[i] for i in range(2)]
    tensors = [(s.k_scale, s.v_scale) for s in scales]
    assert model.fp8_calibration_states() == [False, False]
    assert not gate_open(model)
    layer = model.layers[0]
    hook = first_answer(model_hook(), layer_kind=layer.layer_kind, layer=layer, engine_config=None)
    assert hook == (False, "layerzoo.plugins.defaults")  # the core answers for its own attention

    engine.add_request("a", list(range(1, 12)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    seen = 0
    while seen + 1 < window:
        engine.step()
        seen = scales[0].calibrator.seen
        assert model.fp8_calibration_states() == [False, False], seen
        assert not gate_open(model)
    engine.step()  # the token that reaches the window
    assert scales[0].calibrator.seen == window
    assert model.fp8_calibration_states() == [True, True]
    assert gate_open(model)
    # Frozen in place: the very tensors a graph captured now would read.
    assert all(t is u for pair, s in zip(tensors, scales) for t, u in zip(pair, (s.k_scale, s.v_scale)))
    engine.run_until_done()
    assert model.fp8_calibration_states() == [True, True]


def model_hook():
    from layerzoo.plugins.manager import get_registry

    return get_registry().pm.hook.fp8_calibration_frozen


def test_no_calibration_answers_none(tiny_qwen3_dir):
    plain = LLM(tiny_qwen3_dir, dtype="float32")
    assert plain.loaded.model.fp8_calibration_states() == [None, None] and gate_open(plain.loaded.model)
    assert not plain.engine.kv.fp8
    fixed = LLM(tiny_qwen3_dir, dtype="float32", kv_cache_dtype="fp8", fp8_calibration_tokens=0)
    assert fixed.loaded.model.fp8_calibration_states() == [None, None] and gate_open(fixed.loaded.model)


@pytest.fixture(scope="module")
def tiny_model(tiny_qwen3_dir):
    return load_model(tiny_qwen3_dir, EngineArgs(dtype="float32")).model


def prompts(seed=0, n=6):
    rng = random.Random(seed)
    return [[rng.randrange(64) for _ in range(rng.randrange(5, 40))] for _ in range(n)]


def teacher_forced_logits(model, prompts, steps, kv_cache_dtype, forced=None, calibration_tokens=16, transform=None):
    """Logits ``[steps + 1, B, vocab]``: a batched prefill, then ``steps`` batched decode steps fed
    ``forced[s]`` (or their own greedy tokens)."""
    specs = with_kv_cache_dtype(model.kv_cache_specs(), kv_cache_dtype)
    kv = PagedKVCache(specs, 128, BS, fp8_calibration_tokens=calibration_tokens)
    if transform is not None:
        attend = kv.attend
        kv.attend = lambda layer, q, k, v, s, ctx: attend(layer, q, *transform(layer, k, v), s, ctx)
        kv.decode_operands = lambda layer, ctx: None  # a fused decode layer would write K/V untransformed
    tables, start = [], 0
    for p in prompts:
        n = (len(p) + steps + BS) // BS
        tables.append(list(range(start, start + n)))
        start += n
    tokens = [list(p) for p in prompts]
    with torch.inference_mode():
        lens = [len(p) for p in prompts]
        ctx = step_ctx(kv, lens, lens, tables, 0)
        hidden = model(torch.tensor([t for p in prompts for t in p]), ctx)
        logits = [model.compute_logits(hidden[ctx.last_token_indices()])]
        for s in range(steps):
            new = forced[s] if forced is not None else logits[-1].argmax(-1).tolist()
            for seq, t in zip(tokens, new):
                seq.append(t)
            ctx = step_ctx(kv, [1] * len(prompts), [len(t) for t in tokens], tables, len(prompts))
            logits.append(model.compute_logits(model(torch.tensor(new), ctx)))
    return torch.stack(logits), kv


# Measured on this model (six prompt sets, 8 decode steps): max |Δlogit| / std(logits) 0.25–0.66,
# RMS 0.054–0.077, teacher-forced argmax agreement 0.89–0.98. A bf16 cache gives 0.02–0.04 max:
# this tiny random model (init range 0.25) amplifies a K/V error ~10x, and e4m3 keeps 3 mantissa
# bits (2.7% RMS rounding), so the bounds are wide; the exact check is the fake-quant one below.
MAX_OVER_STD, RMS_OVER_STD, MIN_AGREEMENT = 1.0, 0.12, 0.8


def test_fp8_logits_stay_close_to_an_fp32_cache(tiny_model):
    batch, steps = prompts(), 8
    ref, _ = teacher_forced_logits(tiny_model, batch, steps, "auto")
    forced = [ref[s].argmax(-1).tolist() for s in range(steps)]
    got, kv = teacher_forced_logits(tiny_model, batch, steps, "fp8", forced, calibration_tokens=16)
    assert all(s.calibration_frozen for s in kv.fp8.values())
    diff, std = got - ref, ref.std()
    assert diff.abs().max() < MAX_OVER_STD * std, f"max |Δlogit| {diff.abs().max():.3f}, std {std:.3f}"
    assert diff.pow(2).mean().sqrt() < RMS_OVER_STD * std
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() >= MIN_AGREEMENT

    # Exactly an fp32 cache over K/V rounded through e4m3 at the frozen scales.
    scales = {i: (s.k_scale.clone(), s.v_scale.clone()) for i, s in kv.fp8.items()}
    rounded, _ = teacher_forced_logits(
        tiny_model, batch, steps, "auto", forced,
        transform=lambda i, k, v: (fake_quant(k, scales[i][0]), fake_quant(v, scales[i][1])),
    )
    torch.testing.assert_close(got, rounded, rtol=1e-5, atol=1e-5)


def test_fp8_greedy_generation_mostly_agrees(tiny_qwen3_dir):
    batch = [{"prompt_token_ids": p} for p in prompts(seed=3)]
    want = [o.outputs[0].token_ids for o in LLM(tiny_qwen3_dir, dtype="float32").generate(batch, GREEDY)]
    llm = LLM(tiny_qwen3_dir, dtype="float32", kv_cache_dtype="fp8", fp8_calibration_tokens=64,
              max_num_batched_tokens=48, block_size=8)  # chunked prefill, calibration across steps
    got = [o.outputs[0].token_ids for o in llm.generate(batch, GREEDY)]
    llm.engine.blocks.check_invariants()
    assert gate_open(llm.loaded.model)
    first_agree = sum(a[0] == b[0] for a, b in zip(want, got))
    assert first_agree >= len(batch) - 1, (want, got)


# -- scales from the checkpoint -----------------------------------------------------------------


@pytest.fixture(scope="module")
def scaled_checkpoint(tiny_qwen3_dir, tmp_path_factory):
    """The tiny checkpoint plus ``self_attn.k_scale`` / ``v_scale`` per layer (as vLLM writes them)."""
    import shutil

    path = tmp_path_factory.mktemp("tiny-qwen3-kv-scales")
    for f in tiny_qwen3_dir.iterdir():
        shutil.copy(f, path / f.name)
    tensors = load_file(path / "model.safetensors")
    scales = {}
    for i in range(2):
        scales[i] = (0.01 * (i + 1), 0.02 * (i + 1))
        tensors[f"model.layers.{i}.self_attn.k_scale"] = torch.tensor(scales[i][0])
        tensors[f"model.layers.{i}.self_attn.v_scale"] = torch.tensor(scales[i][1])
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path, scales


def load_with_kv_scales(path, fp8: bool):
    return load_model(path, EngineArgs(dtype="float32", kv_cache_dtype="fp8" if fp8 else "auto"))


def test_checkpoint_scales_replace_calibration(scaled_checkpoint):
    from layerzoo.runtime.engine import LLMEngine
    from layerzoo.tokenization.tokenizer import Tokenizer

    path, scales = scaled_checkpoint
    loaded = load_with_kv_scales(path, fp8=True)
    engine = LLMEngine(loaded, Tokenizer.from_dir(path, config=loaded.hf_config), EngineArgs(kv_cache_dtype="fp8"))
    for i, (k, v) in scales.items():
        pool = engine.kv.fp8[i]
        assert pool.source == "checkpoint"
        assert float(pool.k_scale) == pytest.approx(k) and float(pool.v_scale) == pytest.approx(v)
    assert loaded.model.fp8_calibration_states() == [None, None] and gate_open(loaded.model)
    engine.add_request("a", [1, 2, 3, 4, 5], GREEDY)
    engine.run_until_done()
    assert [float(engine.kv.fp8[i].k_scale) for i in range(2)] == pytest.approx([0.01, 0.02])


def test_llm_loads_checkpoint_scales_only_for_an_fp8_cache(scaled_checkpoint):
    from layerzoo import LLM

    path, scales = scaled_checkpoint
    fp8 = LLM(path, dtype="float32", kv_cache_dtype="fp8")
    assert [float(fp8.engine.kv.fp8[i].k_scale) for i in range(2)] == pytest.approx([k for k, _ in scales.values()])
    plain = LLM(path, dtype="float32")  # the scale keys are skipped, not an "unexpected key" error
    assert plain.generate({"prompt_token_ids": [1, 2, 3]}, GREEDY)[0].outputs[0].token_ids


def test_checkpoint_scales_are_skipped_without_an_fp8_cache(scaled_checkpoint, tiny_qwen3_dir, monkeypatch):
    monkeypatch.setenv("LAYERZOO_CPU_PACKED_LINEAR", "0")  # compare plain weights
    path, _ = scaled_checkpoint
    loaded = load_with_kv_scales(path, fp8=False)
    assert "model.layers.0.self_attn.k_scale" not in loaded.model.state_dict()
    plain = load_model(tiny_qwen3_dir, EngineArgs(dtype="float32")).model
    for name, tensor in plain.state_dict().items():
        assert torch.equal(loaded.model.state_dict()[name], tensor), name


def test_capability_record_reports_the_live_calibration_answer(tiny_qwen3_dir):
    """Gathered at load the answers were None (no scales yet); the record reports what the layers
    answer once the cache is bound (calibrating: False) and after calibration froze (True)."""
    llm = LLM(tiny_qwen3_dir, dtype="float32", kv_cache_dtype="fp8", fp8_calibration_tokens=16)
    caps = llm.capabilities
    assert [lc.fp8_calibration_frozen for lc in caps.layers] == [False, False]
    assert not caps.fp8_graphs_ready
    assert any("until FP8 calibration freezes" in d for d in llm.stats.disabled_features)
    llm.generate({"prompt_token_ids": list(range(1, 30))}, SamplingParams(temperature=0, max_tokens=4))
    caps = llm.capabilities
    assert [lc.fp8_calibration_frozen for lc in caps.layers] == [True, True] and caps.fp8_graphs_ready
