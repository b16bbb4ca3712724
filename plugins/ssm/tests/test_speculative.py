"""Speculative decoding end to end: identical greedy outputs with and without it, for Qwen3 (the
embedded model) and a Gated DeltaNet hybrid, batched, with preemption and prefix caching on; the
per-sequence verify route; the refusal of layers that cannot drop drafts."""

import logging
import random

import pytest

from layerzoo import LLM, SamplingParams, hookimpl
from layerzoo.errors import UserError
from layerzoo.testing import registered_plugin

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "adaptive": False}


plugin = registered_plugin


class Oracle:
    """Proposes the known greedy continuation, with every third proposal's last draft wrong: so
    verifies accept all, some or none of their drafts."""

    expected: dict[tuple[int, ...], list[int]] = {}
    calls = 0

    def propose(self, token_ids, k):
        for prompt, out in self.expected.items():
            if tuple(token_ids[: len(prompt)]) == prompt and len(token_ids) >= len(prompt):
                done = len(token_ids) - len(prompt)
                draft = list(out[done : done + k])
                Oracle.calls += 1
                if draft and Oracle.calls % 3 == 0:
                    draft[-1] = (draft[-1] + 1) % 100
                return draft
        return []

    def propose_batch(self, token_ids, k):
        return [self.propose(t, k) for t in token_ids]


class OracleMethod:
    @hookimpl
    def register_proposers(self, register):
        register("oracle", lambda config: Oracle())


def prompts_for(vocab, lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def run(llm, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


@pytest.fixture(params=["embedded_qwen3", "qwen3_next", "mamba2"])
def model(request):
    if request.param == "embedded_qwen3":
        return None, 200
    path, hf_model = request.getfixturevalue(f"{request.param}_tiny")
    return path, hf_model.config.vocab_size


def test_oracle_drafts_give_identical_greedy_outputs(model):
    path, vocab = model
    prompts = prompts_for(vocab, (40, 5, 70, 12))
    base = run(LLM(path, dtype="float32"), prompts)
    Oracle.expected = {tuple(p): out for p, out in zip(prompts, base)}
    with plugin(OracleMethod(), "oracle-proposer"):
        # A small budget and cache: chunked prompts, preemptions, verifies next to prefills.
        llm = LLM(path, dtype="float32", max_num_batched_tokens=24, max_num_seqs=4, kv_cache_memory=_small_cache(path), max_model_len=192,
                  speculative_config={"method": "oracle", "num_speculative_tokens": 3, "adaptive": False})  # k fixed: drafts fill the cache
        assert run(llm, prompts) == base
        # Again on a warm prefix cache: same outputs, from cached blocks (and state snapshots).
        assert run(llm, [p + [1, 2, 3] for p in prompts[:2]]) == run(LLM(path, dtype="float32"), [p + [1, 2, 3] for p in prompts[:2]])
    st = llm.engine.stats
    assert st.spec_verify_steps > 0 and 0 < st.spec_accepted_tokens < st.spec_draft_tokens
    assert st.prefix_cache_hits > 0
    assert st.preemptions > 0 or not llm.engine.kv.specs  # a model without attention has no KV to run out of
    if llm.engine.states.has_pool:
        assert st.state_snapshot_hits > 0
    assert not llm.engine.states.live and not llm.engine.states.drafts
    llm.engine.states.check_invariants()
    llm.engine.blocks.check_invariants()


def _small_cache(path):
    # Bytes for 12 blocks (enough for every prompt, not for all of them at once) plus the state pool.
    from layerzoo.loading.model_loading import load_model
    from layerzoo.runtime.state_ledger import StateConfig
    from layerzoo.runtime.state_pool import StatePool

    model = load_model(path or _embedded()).model
    per_token = sum(s.bytes_per_token for s in model.kv_cache_specs().values())
    specs = model.state_specs()
    slots = StateConfig(max_seqs=4, draft_slots_per_seq=3).num_slots
    return per_token * 16 * 12 + (StatePool.bytes_for(specs, slots) if specs else 0)


def _embedded():
    from layerzoo.llm import DEFAULT_MODEL
    from layerzoo.loading.hub import resolve_model

    return resolve_model(str(DEFAULT_MODEL))


def test_ngram_on_repetitive_text_accepts_drafts_and_matches():
    llm = LLM(dtype="float32", speculative_config=NGRAM)
    prompts = ["def f(self):\n    return self.value\n\ndef g(self):\n    return self.", "import os\nimport sys\nimport os\nimport"]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    spec = [o.outputs[0].text for o in llm.generate(prompts, params)]
    base = [o.outputs[0].text for o in LLM(dtype="float32").generate(prompts, params)]
    assert spec == base
    st = llm.engine.stats
    assert st.spec_accepted_tokens > 0
    assert st.steps < st.generated_tokens  # more than one token per step on average
    assert st.spec_acceptance_rate == st.spec_accepted_tokens / st.spec_draft_tokens
    assert st.spec_tokens_per_verify == 1 + st.spec_accepted_tokens / st.spec_verify_steps > 1


def test_sampled_requests_speculate_with_rejection_sampling():
    llm = LLM(dtype="float32", speculative_config=NGRAM)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=40, ignore_eos=True)
    out = llm.generate(["import os\nimport sys\nimport os\nimport"], params)[0].outputs[0]
    assert len(out.token_ids) == 40
    assert llm.engine.stats.spec_verify_steps > 0


class NoBatchedVerify:
    @hookimpl(tryfirst=True)
    def decode_verify_multi_unsupported(self, layer_kind):
        return True if layer_kind == "qwen3.decoder" else None


def test_per_sequence_verify_when_a_layer_declines(caplog):
    prompts = ["import os\nimport sys\nimport os\nimport", "x = 1\ny = 2\nx = 1\ny =", "def f():\n    pass\ndef f():\n"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    base = [o.outputs[0].token_ids for o in LLM(dtype="float32").generate(prompts, params)]
    with plugin(NoBatchedVerify(), "no-batched-verify"):
        llm = LLM(dtype="float32", speculative_config=NGRAM)
    runner = llm.engine.runner
    assert runner.per_sequence_verify
    widths = []
    forward = runner._forward
    runner._forward = lambda chunks, nd, *a: (widths.append(sum(c.is_verify for c in chunks)), forward(chunks, nd, *a))[1]
    with caplog.at_level(logging.INFO):
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == base
    assert max(widths) == 1  # never two verifies in one pass
    assert "batched speculative verify is off: layer 0" in caplog.text
    assert caplog.text.count("verifying each sequence's drafts on its own") == 1


class OwnStateQwen3:
    """Qwen3's layers as own-state layers; ``per_draft`` says whether they keep per-draft states."""

    def __init__(self, per_draft):
        self.per_draft = per_draft

    @hookimpl(tryfirst=True)
    def uses_ssm_pool(self, layer_kind):
        return False if layer_kind == "qwen3.decoder" else None

    @hookimpl(tryfirst=True)
    def keeps_per_draft_states(self, layer_kind):
        return self.per_draft if layer_kind == "qwen3.decoder" else None


class _State:
    def __init__(self):
        self.verifies = []


@pytest.fixture
def own_state_layers(monkeypatch):
    from layerzoo_qwen3.model import Qwen3DecoderLayer

    monkeypatch.setattr(Qwen3DecoderLayer, "alloc_state", lambda self, seq_id: _State(), raising=False)
    monkeypatch.setattr(
        Qwen3DecoderLayer, "keep_verified_rows", lambda self, state, kept, run: state.verifies.append((kept, run)), raising=False
    )


def test_own_state_layer_without_per_draft_states_refuses_speculation(own_state_layers, caplog):
    with plugin(OwnStateQwen3(per_draft=False), "own-state"):
        with pytest.raises(UserError, match=r"layer 0 \(Qwen3DecoderLayer\).*keeps_per_draft_states"):
            LLM(dtype="float32", speculative_config=NGRAM)
        with caplog.at_level(logging.WARNING):
            llm = LLM(dtype="float32", speculative_config=NGRAM, speculative_fallback=True)
    assert llm.engine.speculative is None
    assert "speculative decoding is off: layer 0 (Qwen3DecoderLayer)" in caplog.text
    out = llm.generate(["import os\nimport"], SamplingParams(temperature=0, max_tokens=8))[0].outputs[0]
    assert len(out.token_ids) == 8 and llm.engine.stats.spec_verify_steps == 0


def test_own_state_layer_with_per_draft_states_is_told_what_was_kept(own_state_layers):
    with plugin(OwnStateQwen3(per_draft=True), "own-state"):
        llm = LLM(dtype="float32", speculative_config=NGRAM)
    engine = llm.engine
    kept_runs = []
    release = engine.runner.free_own_states

    def record(seq_id):
        for state in engine.runner.own_states.get(seq_id, {}).values():
            kept_runs.extend(state.verifies)
        release(seq_id)

    engine.runner.free_own_states = record
    llm.generate(["import os\nimport sys\nimport os\nimport"], SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    assert engine.stats.spec_verify_steps > 0
    assert kept_runs and all(1 <= kept <= run for kept, run in kept_runs)
    assert any(kept > 1 for kept, _ in kept_runs)


def test_stop_strings_cut_the_same_tokens_with_speculation():
    prompt = "import os\nimport sys\nimport os\nimport"
    params = SamplingParams(temperature=0, max_tokens=40, stop=["list of"])
    plain = LLM(dtype="float32").generate(prompt, params)[0].outputs[0]
    spec = LLM(dtype="float32", speculative_config=NGRAM).generate(prompt, params)[0].outputs[0]
    assert (spec.text, spec.token_ids, spec.finish_reason) == (plain.text, plain.token_ids, plain.finish_reason)


def test_n_completions_and_aborts_with_speculation_on_a_hybrid(qwen3_next_tiny):
    path, hf_model = qwen3_next_tiny
    prompt = prompts_for(hf_model.config.vocab_size, (50,))[0]
    single = run(LLM(path, dtype="float32"), [prompt])[0]
    Oracle.expected = {tuple(prompt): single}
    with plugin(OracleMethod(), "oracle-proposer"):
        llm = LLM(path, dtype="float32", max_num_batched_tokens=32,
                  speculative_config={"method": "oracle", "num_speculative_tokens": 3, "adaptive": False})
    outs = llm.generate({"prompt_token_ids": prompt}, SamplingParams(n=3, temperature=0, max_tokens=24, ignore_eos=True))
    assert [c.token_ids for c in outs[0].outputs] == [single] * 3
    engine = llm.engine
    engine.add_request("a", prompt, GREEDY)
    for _ in range(6):
        engine.step()
    engine.abort_request("a")  # between steps: no verify is open, nothing leaks
    assert not engine.states.live and not engine.states.drafts
    engine.states.check_invariants()
    assert engine.stats.spec_accepted_tokens > 0


class NoInPassCapture:
    """Pool layers that say they cannot capture state inside a pass: per-draft states of a verify
    are captured inside the pass, so speculation must be refused for them, naming the layer."""

    @hookimpl(tryfirst=True)
    def supports_replay_tail_split(self, layer_kind):
        return False if layer_kind.startswith("ssm.") else None


def test_pool_layer_without_in_pass_capture_refuses_speculation(qwen3_next_tiny, caplog):
    path, _ = qwen3_next_tiny
    with registered_plugin(NoInPassCapture(), "no-in-pass"):
        with pytest.raises(UserError, match=r"speculative_config: .*layer \d+ \(.*\).*supports_replay_tail_split"):
            LLM(path, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False})
        with caplog.at_level(logging.WARNING):
            llm = LLM(path, dtype="float32", speculative_config={"method": "ngram", "num_speculative_tokens": 3, "adaptive": False},
                      speculative_fallback=True)
    assert llm.engine.speculative is None
    assert "supports_replay_tail_split" in caplog.text


def test_the_plan_carries_every_free_and_every_kept_verify(qwen3_next_tiny):
    """The runner hears of finished sequences and of the rows a verify kept only through the next
    plan: each free it does is a plan's ``freed``, all of them together every sequence that ran,
    and after a verify that rejected drafts the next plan names the kept rows (``verified``) and
    first copies the state after them from the draft's slot into the live slot."""
    from layerzoo.runtime.plan import StateCopy

    path, hf_model = qwen3_next_tiny
    prompts = prompts_for(hf_model.config.vocab_size, (50, 30))
    singles = run(LLM(path, dtype="float32"), prompts)
    Oracle.expected = {tuple(p): s for p, s in zip(prompts, singles)}
    with plugin(OracleMethod(), "oracle-proposer"):
        llm = LLM(path, dtype="float32",
                  speculative_config={"method": "oracle", "num_speculative_tokens": 3, "adaptive": False})
    engine = llm.engine
    plans, frees = [], []
    schedule, free = engine.scheduler.schedule, engine.runner.free

    def recording():
        plans.append(schedule())
        return plans[-1]

    def freeing(seq_ids):
        frees.append((len(plans) - 1, tuple(seq_ids)))
        free(seq_ids)

    engine.scheduler.schedule, engine.runner.free = recording, freeing
    assert run(llm, prompts) == singles
    assert frees and all(seq_ids == plans[n].freed for n, seq_ids in frees)
    assert sorted(s for _, ids in frees for s in ids) == sorted({c.seq_id for p in plans for c in p.chunks})
    partial = 0
    for before, after in zip(plans, plans[1:]):
        keeps = [c for c in after.state_copies if c.src in {s for slots in before.draft_slots.values() for s in slots}]
        for chunk in before.decodes:
            if not chunk.is_verify or chunk.seq_id in after.freed:  # (finished in that step)
                continue
            kept, rows = after.verified[chunk.seq_id]
            assert rows == chunk.num_tokens and 1 <= kept <= rows
            if kept < rows:
                partial += 1
                copy = StateCopy(before.draft_slots[chunk.seq_id][kept - 1], before.state_slots[chunk.seq_id])
                assert copy in keeps and after.state_copies[: len(keeps)] == tuple(keeps)
    assert partial > 0
