"""The recurrent-state runtime on Gated DeltaNet hybrids: prefix snapshots, capture routes, split
prefill, preemption, abort, n > 1, rollback through the ring, a declined rollback, own-state
layers, and the CLI's capability report. Greedy outputs are compared with transformers and with
runs that take none of the paths under test."""

from __future__ import annotations

import contextlib
import json
import logging
import random

import pytest
import torch

from layerzoo import LLM, SamplingParams, hookimpl
from layerzoo.errors import LayerStateNotRewindable
from layerzoo.runtime.state_pool import StatePool
from layerzoo.testing import registered_plugin

GDN = "ssm.gated_deltanet"


def greedy(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True)


_HF: dict = {}


def hf_greedy(model, prompt, steps):
    key = (id(model), tuple(prompt), steps)
    if key not in _HF:
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
        _HF[key] = out[0, len(prompt) :].tolist()
    return _HF[key]


def tokens_of(outs):
    return [[c.token_ids for c in o.outputs] if len(o.outputs) > 1 else o.outputs[0].token_ids for o in outs]


def gen(llm, prompts, max_tokens=8):
    return tokens_of(llm.generate([{"prompt_token_ids": p} for p in prompts], greedy(max_tokens)))


plugin = registered_plugin


def used_slots(engine) -> int:
    slots = engine.states.slots
    return slots.num_slots - slots.num_free()


class Boundaries:
    """Rollback-ring entries before the positions ``before(seq, position)`` says (the scheduler's
    `BoundaryTokens` answers from the tokens; these tests pick positions)."""

    def __init__(self, before):
        self.before = before


def set_boundaries(engine, before) -> None:
    engine.scheduler.boundaries = Boundaries(before)


def check_idle(engine) -> None:
    """After every request finished or was aborted: nothing but prefix snapshots is held."""
    engine.states.check_invariants()
    engine.blocks.check_invariants()
    assert engine.states.live == {} and not engine.states.own and engine.runner.own_states == {}
    assert engine.states.ring.num_entries() == 0 and engine.states._pending == []
    if engine.states.has_pool:
        assert used_slots(engine) == len(engine.states.snapshots)
    assert engine.blocks.num_free_blocks() == engine.blocks.num_blocks


@pytest.fixture(params=["qwen3_next", "qwen3_5"])
def tiny(request):
    return request.getfixturevalue(f"{request.param}_tiny")


def shared_workload(vocab, seed=0):
    """A (100 tokens); A + B (B: 30 tokens); A's first 80 + D; an unrelated C."""
    rng = random.Random(seed)
    a = [rng.randrange(vocab) for _ in range(100)]
    b = [rng.randrange(vocab) for _ in range(30)]
    c = [rng.randrange(vocab) for _ in range(45)]
    d = [rng.randrange(vocab) for _ in range(25)]
    return a, a + b, a[:80] + d, c


# -- 1. prefix-cache hits resume from state snapshots ------------------------------------------

BUDGET = 40  # chunks [0,40) [40,80) [80,100) of A: a snapshot at the chunk end 80 (a block boundary
# below the capture point) and one inside the last chunk at A's capture point 96


def run_shared(llm, workload):
    """A alone, then A + B, C and A[:80] + D together in a later call."""
    a, ab, ad, c = workload
    first = gen(llm, [a])
    taken = llm.stats.state_snapshots_taken
    return first + gen(llm, [ab, c, ad]), taken


@pytest.fixture(scope="module")
def next_cold(qwen3_next_tiny):
    """The Qwen3-Next workload without prefix caching: the reference for the runs that take snapshots."""
    path, hf_model = qwen3_next_tiny
    workload = shared_workload(hf_model.config.vocab_size)
    cold = LLM(path, dtype="float32", max_num_batched_tokens=BUDGET, enable_prefix_caching=False)
    outs, _ = run_shared(cold, workload)
    assert cold.stats.state_snapshot_hits == 0 and cold.stats.prefix_cache_hits == 0
    _, ab, ad, _ = workload
    assert [outs[1], outs[3]] == [hf_greedy(hf_model, ab, 8), hf_greedy(hf_model, ad, 8)]
    return workload, outs, cold.stats.prefill_tokens_computed


def test_prefix_hits_resume_from_state_snapshots(tiny, request):
    path, hf_model = tiny
    if hf_model.config.model_type == "qwen3_next":
        workload, cold_outs, cold_computed = request.getfixturevalue("next_cold")
    else:
        workload = shared_workload(hf_model.config.vocab_size)
        cold = LLM(path, dtype="float32", max_num_batched_tokens=BUDGET, enable_prefix_caching=False)
        cold_outs, _ = run_shared(cold, workload)
        cold_computed = cold.stats.prefill_tokens_computed
        assert cold_outs[3] == hf_greedy(hf_model, workload[2], 8)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=BUDGET)
    assert llm.engine.runner.in_pass_capture is True
    passes = count_passes(llm)
    outs, taken_by_a = run_shared(llm, workload)
    assert taken_by_a == 2
    assert outs == cold_outs
    # A + B resumed at 96 and A[:80] + D at 80, while C ran beside them
    assert llm.stats.state_snapshot_hits == 2 and llm.stats.prefix_cache_hits == 6 + 5
    assert llm.stats.prefill_tokens_computed == cold_computed - 96 - 80
    assert any(passes) and len(passes) == llm.stats.steps  # captures taken inside single passes
    check_idle(llm.engine)


# -- 2. captures in-pass, or by splitting the chunk into passes -----------------------------------


class NoReplayTailSplit:
    @hookimpl(tryfirst=True)
    def supports_replay_tail_split(self, layer_kind):
        return False if layer_kind == GDN else None


def count_passes(llm):
    """Wrap the runner's forward: records, per pass, whether captures went to the layers in-pass."""
    runner, passes = llm.engine.runner, []
    forward = runner._forward

    def counted(chunks, num_decodes, plan, inner_captures=()):
        passes.append(any(inner_captures))
        return forward(chunks, num_decodes, plan, inner_captures)

    runner._forward = counted
    return passes


def test_captures_split_into_passes_when_a_layer_cannot_capture_in_pass(qwen3_next_tiny, next_cold, caplog):
    path, _ = qwen3_next_tiny
    workload, cold_outs, _ = next_cold
    with plugin(NoReplayTailSplit(), "no-replay-tail-split"), caplog.at_level(logging.INFO):
        split = LLM(path, dtype="float32", max_num_batched_tokens=BUDGET)
    assert split.engine.runner.in_pass_capture is False
    assert ("state snapshots inside a prefill chunk take two passes: layer 0 (GatedDeltaNetDecoderLayer) answers "
            "supports_replay_tail_split False (plugin no-replay-tail-split)") in caplog.text
    assert any("in-pass replay-tail capture" in f for f in split.stats.disabled_features)
    passes = count_passes(split)
    outs, taken_by_a = run_shared(split, workload)
    assert outs == cold_outs
    assert taken_by_a == 2 and split.stats.state_snapshot_hits == 2
    # never an in-pass capture; each capture inside a chunk cost one more pass than steps
    assert not any(passes) and len(passes) > split.stats.steps
    check_idle(split.engine)


# -- 3. the split-prefill route ------------------------------------------------------------------


class NotSsm:
    @hookimpl(tryfirst=True)
    def is_ssm_layer(self, layer_kind):
        return False if layer_kind == GDN else None


def test_split_prefill_route_and_the_one_call_route(qwen3_next_tiny, monkeypatch):
    from layerzoo_ssm.gated_deltanet import GatedDeltaNetDecoderLayer as Layer

    path, hf_model = qwen3_next_tiny
    calls = {"direct_phases": 0, "prefill": 0, "decode": 0}
    depth = [0]

    def wrap_phase(name):
        original = getattr(Layer, name)

        def phase(self, *args):
            if depth[0] == 0:  # called by the model, not from inside prefill/decode
                calls["direct_phases"] += 1
            return original(self, *args)

        monkeypatch.setattr(Layer, name, phase)

    def wrap_call(name):
        original = getattr(Layer, name)

        def whole(self, *args):
            calls[name] += 1
            depth[0] += 1
            try:
                return original(self, *args)
            finally:
                depth[0] -= 1

        monkeypatch.setattr(Layer, name, whole)

    for name in ("prefill_phase1", "prefill_phase3"):
        wrap_phase(name)
    wrap_call("prefill")
    wrap_call("decode")

    rng = random.Random(2)
    prompts = [[rng.randrange(hf_model.config.vocab_size) for _ in range(n)] for n in (50, 7)]
    split = LLM(path, dtype="float32", max_num_batched_tokens=32)
    assert split.capabilities.ssm_split_prefill_layers == (0, 2)
    out_split = gen(split, prompts)
    assert calls["direct_phases"] > 0 and calls["prefill"] == 0 and calls["decode"] > 0
    # every prefill pass called the two phases of both GDN layers (the core runs phase 2)
    assert calls["direct_phases"] % (2 * 2) == 0

    with plugin(NotSsm(), "not-ssm"):
        whole = LLM(path, dtype="float32", max_num_batched_tokens=32)
    assert whole.capabilities.ssm_split_prefill_layers == ()
    calls.update(direct_phases=0, prefill=0, decode=0)
    out_whole = gen(whole, prompts)
    assert calls["direct_phases"] == 0 and calls["prefill"] > 0 and calls["decode"] > 0
    assert out_split == out_whole == [hf_greedy(hf_model, p, 8) for p in prompts]


def test_the_split_route_runs_every_prompt_in_one_recurrence_call(qwen3_next_tiny, monkeypatch):
    """The answer changes the work: with is_ssm_layer the prefill step makes one recurrence call per
    GDN layer for all its prompts (one varlen call); flipped False, one per prompt."""
    import layerzoo.layers.recurrent_pool as recurrent_pool

    path, hf_model = qwen3_next_tiny
    lookup = recurrent_pool.kernel
    calls = []

    def counting(op):
        fn = lookup(op)
        if op == "delta_rule_decode":
            return fn

        def call(q, *args, cu_seqlens=None, **kwargs):
            calls.append(1 if cu_seqlens is None else cu_seqlens.numel() - 1)
            return fn(q, *args, cu_seqlens=cu_seqlens, **kwargs)

        return call

    monkeypatch.setattr(recurrent_pool, "kernel", counting)
    rng = random.Random(5)
    lengths = (7, 40, 12, 90, 3)  # short ones take the plain recurrence on the one-call route
    prompts = [[rng.randrange(hf_model.config.vocab_size) for _ in range(n)] for n in lengths]
    args = dict(dtype="float32", max_num_batched_tokens=256, enable_prefix_caching=False)
    split = LLM(path, **args)
    out_split = gen(split, prompts, 4)
    # one prefill step, two GDN layers: one call each, over the five prompts
    assert calls == [len(prompts)] * 2

    calls.clear()
    with plugin(NotSsm(), "not-ssm"):
        whole = LLM(path, **args)
    out_whole = gen(whole, prompts, 4)
    assert calls == [1] * (len(prompts) * 2)
    assert out_split == out_whole == [hf_greedy(hf_model, p, 4) for p in prompts]


# -- 4. preemption ---------------------------------------------------------------------------


def test_preemption_frees_every_state_and_changes_no_output(qwen3_next_tiny):
    path, hf_model = qwen3_next_tiny
    rng = random.Random(3)
    shared = [rng.randrange(hf_model.config.vocab_size) for _ in range(36)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(hf_model.config.vocab_size) for _ in range(n)] for i, n in enumerate((30, 22, 51, 9, 40))]
    roomy = LLM(path, dtype="float32", max_num_batched_tokens=64)
    expected = gen(roomy, prompts, 10)

    engine = roomy.engine
    per_token = sum(s.bytes_per_token for s in engine.model.kv_cache_specs().values())
    state_bytes = StatePool.bytes_for(engine.runner.pool.specs, engine.runner.pool.num_slots)
    tight = LLM(path, dtype="float32", max_num_batched_tokens=64, kv_cache_memory=per_token * 160 + state_bytes, max_model_len=160)
    assert tight.engine.blocks.num_blocks == 10
    set_boundaries(tight.engine, lambda seq, pos: pos % 3 == 0)  # ring entries to free on preemption
    assert gen(tight, prompts, 10) == expected
    assert tight.stats.preemptions > 0 and tight.stats.state_snapshot_hits > 0
    check_idle(tight.engine)


# -- 5. abort -----------------------------------------------------------------------------------


def test_abort_mid_prefill_and_mid_decode_leaks_no_slot(qwen3_next_tiny):
    path, hf_model = qwen3_next_tiny
    rng = random.Random(4)
    p1, p2, p3 = ([rng.randrange(hf_model.config.vocab_size) for _ in range(n)] for n in (70, 50, 25))
    llm = LLM(path, dtype="float32", max_num_batched_tokens=30)
    engine = llm.engine
    set_boundaries(engine, lambda seq, pos: True)  # a ring entry before every decoded token
    (s1,) = engine.add_request("a", p1, greedy(10))
    (s2,) = engine.add_request("b", p2, greedy(10))
    (s3,) = engine.add_request("c", p3, greedy(10))
    for _ in range(3):
        engine.step()
    assert 0 < s2.num_cached < len(p2) and s2.seq_id in engine.states.live  # mid-prefill
    engine.abort_request("b")
    engine.states.check_invariants()
    assert s2.seq_id not in engine.states.live
    while len(s1.output_token_ids) < 4:
        engine.step()
    assert engine.states.ring.entries(s1.seq_id)  # mid-decode, with ring entries
    engine.abort_request("a")
    engine.states.check_invariants()
    assert s1.seq_id not in engine.states.live and not engine.states.ring.entries(s1.seq_id)
    while engine.has_unfinished():
        engine.step()
        engine.states.check_invariants()
    assert s3.output_token_ids == hf_greedy(hf_model, p3, 10)
    assert s1.finish_reason.value == s2.finish_reason.value == "abort"
    engine.release("c")
    check_idle(engine)


# -- 6. n > 1 ------------------------------------------------------------------------------------


def test_n_greedy_completions_equal_the_single_one(qwen3_next_tiny):
    path, hf_model = qwen3_next_tiny
    prompt = [(i * 7) % hf_model.config.vocab_size for i in range(45)]
    llm = LLM(path, dtype="float32")
    (out,) = llm.generate({"prompt_token_ids": prompt}, greedy(10, n=3))
    single = hf_greedy(hf_model, prompt, 10)
    assert [c.token_ids for c in out.outputs] == [single] * 3
    # the siblings forked the first completion's blocks up to its snapshot at 32 (capture point)
    assert llm.stats.state_snapshot_hits == 2
    assert llm.stats.prefill_tokens_computed == 45 + 2 * (45 - 32)
    check_idle(llm.engine)


# -- 7. rollback_to_boundary ----------------------------------------------------------------------

PROMPT_LEN, KEEP, MAX_TOKENS = 50, 6, 14
P = PROMPT_LEN + KEEP  # the rollback keeps KEEP output tokens; the KV cursor goes to P - 1


def rollback_run(path, prompt, boundary, *, keep_boundary_after=False):
    llm = LLM(path, dtype="float32")
    engine = llm.engine
    set_boundaries(engine, boundary)
    (seq,) = engine.add_request("r", prompt, greedy(MAX_TOKENS))
    while len(seq.output_token_ids) < KEEP + 3:
        engine.step()
    computed = engine.stats.prefill_tokens_computed
    engine.scheduler.rollback_to_boundary(seq, P)
    engine.outputs.reset(seq, engine.tokenizer.decode(seq.output_token_ids))
    assert len(seq) == P and seq.num_rollbacks == 1
    engine.states.check_invariants()
    restored_at = seq.num_cached
    if not keep_boundary_after:
        set_boundaries(engine, lambda s, pos: False)
    while engine.has_unfinished():
        engine.step()
        engine.states.check_invariants()
    engine.release("r")
    check_idle(engine)
    return seq, restored_at, engine.stats.prefill_tokens_computed - computed


def test_rollback_restores_the_ring_snapshot(qwen3_next_tiny):
    path, hf_model = qwen3_next_tiny
    prompt = [(i * 5 + 3) % hf_model.config.vocab_size for i in range(PROMPT_LEN)]
    seq, restored_at, recomputed = rollback_run(path, prompt, lambda s, pos: pos == P - 1)
    assert restored_at == P - 1  # the ring entry taken before feeding token P - 1
    assert recomputed == 0  # nothing was recomputed: it decoded on from the restored state
    assert seq.output_token_ids == hf_greedy(hf_model, prompt, MAX_TOKENS)


def test_rollback_without_a_ring_entry_recomputes_from_a_prefix_snapshot(qwen3_next_tiny):
    path, hf_model = qwen3_next_tiny
    prompt = [(i * 5 + 3) % hf_model.config.vocab_size for i in range(PROMPT_LEN)]
    seq, restored_at, recomputed = rollback_run(path, prompt, lambda s, pos: False)
    assert restored_at == 48 < P - 1  # the prompt's snapshot at its capture point (49 // 16 * 16)
    assert recomputed == P - 48  # positions 48 .. P - 1, the last one fed again as before
    assert seq.output_token_ids == hf_greedy(hf_model, prompt, MAX_TOKENS)


def test_rollback_of_a_mamba2_model_restores_its_ring_snapshot(mamba2_tiny):
    """The Mamba2 mixer keeps its state in the same pool, so the same ring rewinds it."""
    path, hf_model = mamba2_tiny
    prompt = [(i * 5 + 3) % hf_model.config.vocab_size for i in range(PROMPT_LEN)]
    seq, restored_at, recomputed = rollback_run(path, prompt, lambda s, pos: pos == P - 1)
    assert (restored_at, recomputed) == (P - 1, 0)
    assert seq.output_token_ids == hf_greedy(hf_model, prompt, MAX_TOKENS)


def test_rollback_then_refeeding_the_boundary_token(qwen3_next_tiny):
    """What the loop watchdog does: rewind to just after a boundary token, which is then fed again
    and is still a boundary token."""
    path, hf_model = qwen3_next_tiny
    prompt = [(i * 5 + 3) % hf_model.config.vocab_size for i in range(PROMPT_LEN)]
    seq, restored_at, _ = rollback_run(path, prompt, lambda s, pos: pos == P - 1, keep_boundary_after=True)
    assert restored_at == P - 1
    assert seq.output_token_ids == hf_greedy(hf_model, prompt, MAX_TOKENS)


# -- 8. a declined rollback ---------------------------------------------------------------------


class Unrewindable:
    @hookimpl(tryfirst=True)
    def decode_rollback_unsupported(self, layer_kind):
        return True if layer_kind == GDN else None


def test_rollback_declined_names_the_layer(qwen3_next_tiny):
    path, hf_model = qwen3_next_tiny
    with plugin(Unrewindable(), "unrewindable-gdn"):
        llm = LLM(path, dtype="float32")
    engine = llm.engine
    assert llm.capabilities.rollback_veto
    (seq,) = engine.add_request("r", list(range(1, 20)), greedy(8))
    while len(seq.output_token_ids) < 4:
        engine.step()
    before = (list(seq.output_token_ids), seq.num_cached)
    with pytest.raises(LayerStateNotRewindable) as info:
        engine.scheduler.rollback_to_boundary(seq, 19 + 2)
    assert info.value.layer_index == 0 and info.value.layer_class == "GatedDeltaNetDecoderLayer"
    assert "layer 0 (GatedDeltaNetDecoderLayer, answered by unrewindable-gdn)" in str(info.value)
    assert (seq.output_token_ids, seq.num_cached) == before and seq.num_rollbacks == 0
    # the watchdog's re-steer declines and counts why (called directly: the tiny model does not loop)
    engine._resteer(engine.watchdog._resteer(seq, 3))
    assert engine.watchdog.counts == {"declined_not_rewindable": 1}
    assert (seq.output_token_ids, seq.num_cached) == before
    engine.run_until_done()
    assert seq.output_token_ids == hf_greedy(hf_model, list(range(1, 20)), 8)
    engine.release("r")
    check_idle(engine)


# -- 9. own-state layers (uses_ssm_pool False) -----------------------------------------------------

OWN_KIND = "test.own_state"
OWN_ARCH = "OwnStateQwen3ForCausalLM"


class OwnState:
    def __init__(self, seq_id, layer_index):
        self.seq_id, self.layer_index = seq_id, layer_index
        self.positions: list[int] = []
        self.released = 0


def own_state_classes(log):
    from layerzoo_qwen3.model import Qwen3DecoderLayer, Qwen3ForCausalLM

    class OwnStateLayer(Qwen3DecoderLayer):
        layer_kind = OWN_KIND

        def alloc_state(self, seq_id):
            state = OwnState(seq_id, self.layer_index)
            log["states"].append(state)
            return state

        def release_state(self, state):
            state.released += 1

        def _record(self, ctx):
            log["ssm"].append(ctx.ssm)
            states = ctx.layer_states[self.layer_index]
            starts = ctx.query_start_tensor().tolist()
            assert len(states) == ctx.num_seqs
            for b, state in enumerate(states):
                assert state.seq_id == ctx.seq_ids[b] and not state.released
                state.positions.extend(ctx.positions[starts[b] : starts[b + 1]].tolist())

        def prefill(self, hidden, residual, ctx):
            self._record(ctx)
            return super().prefill(hidden, residual, ctx)

        def decode(self, hidden, residual, ctx):
            self._record(ctx)
            return super().decode(hidden, residual, ctx)

    class OwnStateQwen3ForCausalLM(Qwen3ForCausalLM):
        decoder_layer = OwnStateLayer

    return OwnStateLayer, OwnStateQwen3ForCausalLM


class OwnStatePlugin:
    def __init__(self, log):
        self.layer, self.model = own_state_classes(log)

    @hookimpl
    def register_architectures(self, register):
        register(OWN_ARCH, self.model)

    @hookimpl
    def register_layer_kinds(self, register):
        register(OWN_KIND, self.layer, "Qwen3 decoder keeping a per-sequence state of its own (test)")

    @hookimpl(tryfirst=True)
    def uses_ssm_pool(self, layer_kind):
        return False if layer_kind == OWN_KIND else None


@pytest.fixture(scope="module")
def own_state_dirs(tmp_path_factory):
    """The same tiny dense Qwen3 weights twice: as Qwen3ForCausalLM and as the own-state architecture."""
    transformers = pytest.importorskip("transformers")
    from layerzoo.testing import write_word_tokenizer

    root = tmp_path_factory.mktemp("own-state")
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=131, hidden_size=48, intermediate_size=72, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24,
        max_position_embeddings=512, rope_theta=10000.0, tie_word_embeddings=False,
        eos_token_id=None, bos_token_id=None, pad_token_id=None, initializer_range=0.25,
    )
    config._attn_implementation = "eager"
    model = transformers.Qwen3ForCausalLM(config).eval()
    plain, own = root / "plain", root / "own"
    for path in (plain, own):
        model.save_pretrained(path)
        write_word_tokenizer(path, config.vocab_size)
    cfg = json.loads((own / "config.json").read_text())
    cfg["architectures"] = [OWN_ARCH]
    (own / "config.json").write_text(json.dumps(cfg))
    return plain, own


@contextlib.contextmanager
def own_state_llm(own_dir, **engine_args):
    log = {"states": [], "ssm": []}
    with plugin(OwnStatePlugin(log), "own-state-test"):
        llm = LLM(own_dir, dtype="float32", **engine_args)
        yield llm, log


def own_workload(seed, vocab=131):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in (40, 23, 57, 8, 33)]


def check_own_states(llm, log, seqs_by_id):
    """Each state saw positions 0, 1, ... in order; the last one of each sequence all but its last token."""
    assert log["states"] and all(ssm is None for ssm in log["ssm"])  # no pool for this model
    assert all(s.released == 1 for s in log["states"]), "release_state once for every allocated state"
    layers = llm.capabilities.own_state_layers
    for seq_id, seq in seqs_by_id.items():
        mine = [s for s in log["states"] if s.seq_id == seq_id]
        assert len(mine) == len(layers) * (1 + seq.num_preemptions)  # a preempted sequence gets fresh states
        for state in mine:
            assert state.positions == list(range(len(state.positions))), (seq_id, state.layer_index, state.positions[:5])
        for state in mine[-len(layers) :]:
            assert state.positions == list(range(len(seq) - 1))


def test_own_state_layers_allocated_fed_and_released_by_the_state_ledger(own_state_dirs):
    plain_dir, own_dir = own_state_dirs
    prompts = own_workload(5)
    expected = gen(LLM(plain_dir, dtype="float32", max_num_batched_tokens=24), prompts, 12)
    # Prefix caching off: see test_own_state_layers_with_prefix_hits for why.
    with own_state_llm(own_dir, max_num_batched_tokens=24, enable_prefix_caching=False, kv_cache_memory=1152 * 100, max_model_len=96) as (llm, log):
        engine = llm.engine
        assert llm.capabilities.own_state_layers == (0, 1, 2) and not engine.states.has_pool
        assert engine.states.active and engine.scheduler.cache.states is engine.states
        seqs = {}
        for i, p in enumerate(prompts):
            (seq,) = engine.add_request(str(i), p, greedy(12))
            seqs[seq.seq_id] = seq
        (aborted,) = engine.add_request("x", prompts[2], greedy(12))
        while engine.has_unfinished():
            engine.step()
            for seq in engine.scheduler.running:  # the state ledger owns every running sequence's states
                owned = engine.runner.own_states[seq.seq_id]
                assert sorted(owned) == [0, 1, 2] and all(owned[i] in log["states"] for i in owned)
            if aborted.seq_id in engine.runner.own_states and not aborted.finished:  # abort it once it holds states
                engine.abort_request("x")
                assert engine.scheduler.has_frees() or not engine.has_unfinished()  # the next plan frees them
                if engine.has_unfinished():
                    engine.step()
                assert aborted.seq_id not in engine.runner.own_states
        assert aborted.finish_reason.value == "abort"
        outs = [seqs_by.output_token_ids for seqs_by in seqs.values()]
        assert outs == expected
        assert engine.stats.preemptions > 0
        for i in range(len(prompts)):
            engine.release(str(i))
        check_idle(engine)
        aborted_states = [s for s in log["states"] if s.seq_id == aborted.seq_id]
        assert len(aborted_states) >= 3 and all(s.released == 1 for s in aborted_states)
        check_own_states(llm, log, seqs)


def test_own_state_layers_with_prefix_hits(own_state_dirs):
    plain_dir, own_dir = own_state_dirs
    prompts = own_workload(6)
    prompts = [prompts[0], prompts[0][:32] + prompts[1]]  # the second shares two blocks of the first
    expected = gen(LLM(plain_dir, dtype="float32"), prompts[:1]) + gen(LLM(plain_dir, dtype="float32"), prompts[1:])
    with own_state_llm(own_dir) as (llm, log):
        outs = gen(llm, prompts[:1]) + gen(llm, prompts[1:])
        assert outs == expected  # (the Qwen3 arithmetic does not read the own state)
        for state in log["states"]:
            assert state.positions[:1] == [0], (state.seq_id, state.layer_index, state.positions[:3])


def test_own_state_layers_with_n_siblings(own_state_dirs):
    _, own_dir = own_state_dirs
    with own_state_llm(own_dir, enable_prefix_caching=False) as (llm, log):
        llm.generate({"prompt_token_ids": list(range(3, 40))}, greedy(4, n=3))
        for state in log["states"]:
            assert state.positions[:1] == [0], (state.seq_id, state.layer_index, state.positions[:3])


def test_own_state_layers_after_a_rollback(own_state_dirs):
    """Right is either a decline (LayerStateNotRewindable) or a state that restarts (fresh, from 0)."""
    _, own_dir = own_state_dirs
    prompt = list(range(3, 23))
    with own_state_llm(own_dir, enable_prefix_caching=False) as (llm, log):
        engine = llm.engine
        (seq,) = engine.add_request("r", prompt, greedy(10))
        while len(seq.output_token_ids) < 6:
            engine.step()
        try:
            engine.scheduler.rollback_to_boundary(seq, len(prompt) + 2)
        except LayerStateNotRewindable:
            return
        engine.outputs.reset(seq, engine.tokenizer.decode(seq.output_token_ids))
        engine.run_until_done()
        current = [s for s in log["states"] if s.seq_id == seq.seq_id][-3:]
        for state in current:
            assert state.positions == list(range(len(seq) - 1)), state.positions


# -- 10. the CLI's capability report ----------------------------------------------------------------


def test_cli_lists_the_ssm_answers_per_layer(qwen3_next_tiny, capsys):
    from layerzoo.entrypoints.cli import main

    path, _ = qwen3_next_tiny
    assert main(["plugins", "--capabilities", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["architecture"] == "Qwen3NextForCausalLM" and report["plugin"] == "ssm"
    kinds = [layer["kind"] for layer in report["layers"]]
    assert kinds == [GDN, "ssm.gated_attention", GDN, "ssm.gated_attention"]
    for layer in report["layers"]:
        answers, by = layer["answers"], layer["answered_by"]
        # The plugin answers only what differs from the core's defaults.
        assert answers["is_ssm_layer"] is (layer["kind"] == GDN)
        assert by["is_ssm_layer"] == ("ssm" if layer["kind"] == GDN else "layerzoo.plugins.defaults")
        assert answers["uses_ssm_pool"] is True and answers["supports_replay_tail_split"] is True
        assert by["supports_replay_tail_split"] == "ssm"
        assert answers["decode_rollback_unsupported"] is False and by["decode_rollback_unsupported"] == "layerzoo.plugins.defaults"
    assert report["model"]["ssm_split_prefill_layers"] == [0, 2]
    assert report["model"]["replay_tail_split_supported"] is True and report["model"]["own_state_layers"] == []

    assert main(["plugins", "--capabilities", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Qwen3NextForCausalLM (plugin ssm)"
    for line, kind in zip(lines[1:5], kinds):
        assert kind in line and ("is_ssm_layer" in line) is (kind == GDN)


@pytest.mark.parametrize("in_pass", [True, False])
def test_snapshot_interval_lets_a_partly_shared_prefix_resume(qwen3_next_tiny, in_pass):
    """Two prompts share 40 tokens: only a snapshot inside the first prompt (every 2 blocks) lets
    the second resume; outputs stay identical to transformers."""
    path, hf_model = qwen3_next_tiny
    vocab = hf_model.config.vocab_size
    shared = [(i * 7 + 1) % vocab for i in range(40)]
    first, second = shared + [(i * 3) % vocab for i in range(60)], shared + [(i * 11) % vocab for i in range(9)]

    class TwoPass:
        @hookimpl(tryfirst=True)
        def supports_replay_tail_split(self, layer_kind):
            return None if in_pass else False

    with plugin(TwoPass(), "two-pass"):
        llm = LLM(path, dtype="float32", ssm_snapshot_interval=2, max_num_batched_tokens=64)
        plain = LLM(path, dtype="float32", max_num_batched_tokens=64)
    assert gen(llm, [first]) == gen(plain, [first]) == [hf_greedy(hf_model, first, 8)]
    assert gen(llm, [second]) == [hf_greedy(hf_model, second, 8)]
    assert gen(plain, [second]) == [hf_greedy(hf_model, second, 8)]
    assert llm.engine.stats.state_snapshot_hits == 1 and plain.engine.stats.state_snapshot_hits == 0
    check_idle(llm.engine)
