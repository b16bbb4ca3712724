"""Mamba2 against transformers' `Mamba2ForCausalLM` (its torch path) on tiny random checkpoints:
logits of every position however a prompt is chunked, the pool state at capture rows, mixed
decode/prompt steps, and greedy generation through the engine (chunked prefill, prefix-cache state
snapshots, captures in-pass or split into passes)."""

import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

transformers = pytest.importorskip("transformers")

from layerzoo import LLM, SamplingParams, hookimpl  # noqa: E402
from layerzoo.engine_args import EngineArgs  # noqa: E402
from layerzoo.layers.context import ForwardContext  # noqa: E402
from layerzoo.loading.model_loading import load_model  # noqa: E402
from layerzoo.plugins.manager import get_registry  # noqa: E402
from layerzoo.runtime.state_pool import SlotAllocator, SsmStep, StatePool  # noqa: E402
from layerzoo.testing import write_word_tokenizer  # noqa: E402

VOCAB = 300
MAX_TOKENS = 14
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
# Small enough that the long prompts spread over several steps, chunk ends off the 64-row SSD chunks.
ENGINE = dict(dtype="float32", max_num_batched_tokens=40, block_size=16, max_model_len=512, max_num_seqs=8)


def mamba2_config(**overrides):
    base = dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=3, state_size=16, head_dim=16, num_heads=8,
        expand=2, n_groups=2, conv_kernel=4, chunk_size=64, initializer_range=0.25,
        tie_word_embeddings=False, eos_token_id=None, bos_token_id=None, pad_token_id=None,
    )
    base.update(overrides)
    return transformers.Mamba2Config(**base)


CONFIGS = {
    "g2": lambda: mamba2_config(),
    # one group, tied head, a short SSD chunk and a dt clamp that bites (prefill parity only:
    # transformers clamps dt in its chunked scan but not in its decode step)
    "g1-tied": lambda: mamba2_config(
        num_hidden_layers=2, n_groups=1, tie_word_embeddings=True, chunk_size=32, time_step_limit=(0.02, 0.3)
    ),
}


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("mamba2")
    out = {}
    for seed, (name, make) in enumerate(CONFIGS.items()):
        torch.manual_seed(seed)
        model = transformers.Mamba2ForCausalLM(make()).eval()
        model.save_pretrained(root / name)
        write_word_tokenizer(root / name, VOCAB)
        out[name] = (root / name, model)
    return out


def ours(path, dtype="float32"):
    return load_model(path, EngineArgs(dtype=dtype)).model


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


class Steps:
    """Steps over a hand-built state pool: ``step([(seq, token_ids), ...], captures)``; a one-token
    row of a sequence that has started is a decode row (they must come first)."""

    def __init__(self, model, num_slots=8):
        self.model = model
        self.pool = StatePool(model.state_specs(), num_slots)
        self.allocator = SlotAllocator(num_slots)  # the ledger's half: which slot is whose
        self.slots, self.done = {}, {}

    def step(self, rows, captures=()):
        for seq, _ in rows:
            if seq not in self.slots:
                self.slots[seq] = self.allocator.allocate()
                self.done[seq] = 0
        is_decode = [len(ids) == 1 and self.done[seq] > 0 for seq, ids in rows]
        nd = sum(is_decode)
        assert all(is_decode[:nd]) and not any(is_decode[nd:])
        lens = [len(ids) for _, ids in rows]
        ctx = ForwardContext(
            positions=torch.cat([torch.arange(self.done[s], self.done[s] + n) for (s, _), n in zip(rows, lens)]),
            seq_ids=tuple(s for s, _ in rows),
            query_lens=tuple(lens),
            context_lens=tuple(self.done[s] + n for (s, _), n in zip(rows, lens)),
            num_decodes=nd,
        )
        ctx.ssm = SsmStep(pool=self.pool, slots=tuple(self.slots[s] for s, _ in rows), captures=tuple(captures))
        ids = torch.tensor([t for _, r in rows for t in r])
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(ids, ctx))
        for (s, _), n in zip(rows, lens):
            self.done[s] += n
        return list(logits.split(lens))

    def run(self, ids, chunks, seq=0):
        """One sequence in chunks of the given sizes; all positions' logits."""
        out, done = [], 0
        for n in chunks:
            out += self.step([(seq, ids[done : done + n])])
            done += n
        return torch.cat(out)

    def state(self, seq_or_slot, by_slot=False):
        slot = seq_or_slot if by_slot else self.slots[seq_or_slot]
        return [(self.pool.conv[i][slot].clone(), self.pool.recurrent[i][slot].clone()) for i in self.pool.layers]


def assert_states_equal(a, b, tol=1e-4):
    for (ca, ra), (cb, rb) in zip(a, b):
        torch.testing.assert_close(ca, cb, atol=tol, rtol=tol)
        torch.testing.assert_close(ra, rb, atol=tol, rtol=tol)


def prompt(rng, n):
    return [rng.randrange(VOCAB) for _ in range(n)]


# -- the model on its own --------------------------------------------------------------------


@pytest.mark.parametrize("name", list(CONFIGS))
def test_prefill_logits_match_transformers_however_chunked(models, name):
    path, hf_model = models[name]
    model = ours(path)
    assert model.capabilities.replay_tail_split_supported and not model.capabilities.ssm_split_prefill_layers
    ids = prompt(random.Random(1), 150)
    ref = hf_logits(hf_model, ids)
    # whole; chunks off the SSD chunk grid; single rows in the middle, which run as decode rows
    for chunks in ([150], [37, 64, 1, 1, 47], [3, 1, 1, 1, 70, 74]):
        torch.testing.assert_close(Steps(model).run(ids, chunks), ref, atol=1e-4, rtol=1e-4)


def test_mixed_step_and_captures_match_sequences_alone(models):
    """One step holding a decode row, a fresh prompt and a continued prompt gives each sequence
    what it gets alone; a capture row inside a chunk leaves in its slot the state a pass ending
    there leaves (and changes no output)."""
    path, _ = models["g2"]
    model = ours(path)
    rng = random.Random(2)
    a, b, c = prompt(rng, 101), prompt(rng, 70), prompt(rng, 70)

    alone = {}
    for seq, ids, chunks in (("a", a, [100, 1]), ("b", b, [70]), ("c", c, [40, 30])):
        alone[seq] = Steps(model).run(ids, chunks)
    # states after the prefixes the captures below ask for
    prefix_states = {}
    for n in (16, 48, 64):
        runner = Steps(model)
        runner.run(b, [n])
        prefix_states[n] = runner.state(0)

    runner = Steps(model, num_slots=12)
    runner.step([("a", a[:100])])
    runner.step([("c", c[:40])])
    caps = [runner.allocator.allocate() for _ in range(3)]
    # rows: a decodes, b runs 70 rows with captures at 16, 48 and 64, c continues with 30 rows
    captures = ((), ((16, caps[0]), (48, caps[1]), (64, caps[2])), ())
    out = runner.step([("a", a[100:]), ("b", b), ("c", c[40:])], captures)
    torch.testing.assert_close(out[0], alone["a"][100:], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[1], alone["b"], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out[2], alone["c"][40:], atol=1e-4, rtol=1e-4)
    for slot, n in zip(caps, (16, 48, 64)):
        assert_states_equal(runner.state(slot, by_slot=True), prefix_states[n])

    # a prompt resumed from a captured state continues as the whole prompt does
    resumed = Steps(model, num_slots=4)
    resumed.slots["b"], resumed.done["b"] = resumed.allocator.allocate(), 48
    for i in resumed.pool.layers:
        resumed.pool.conv[i][resumed.slots["b"]] = runner.pool.conv[i][caps[1]]
        resumed.pool.recurrent[i][resumed.slots["b"]] = runner.pool.recurrent[i][caps[1]]
    (tail,) = resumed.step([("b", b[48:])])
    torch.testing.assert_close(tail, alone["b"][48:], atol=1e-4, rtol=1e-4)


def test_bf16_keeps_an_fp32_residual_stream(models):
    path, hf_model = models["g2"]
    model = ours(path, "bfloat16")
    assert model.state_specs()[0].conv_dtype == torch.bfloat16
    assert model.state_specs()[0].recurrent_dtype == torch.float32
    ids = prompt(random.Random(3), 90)
    ref = hf_logits(hf_model, ids)
    got = Steps(model).run(ids, [50, 1, 1, 38])
    assert got.dtype == torch.float32
    err = (got - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()
    assert err < 3e-2, err


# -- through the engine ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def workload(models):
    """Long prompts (over the SSD chunk, spread over several steps) batched with short ones, and
    transformers' greedy continuation of each."""
    _, hf_model = models["g2"]
    rng = random.Random(4)
    prompts = [prompt(rng, n) for n in (70, 131, 5, 150, 9, 23)]
    shared = prompts[0]
    extended = [shared + prompt(rng, 25), shared + prompt(rng, 41)]  # share the first 64 rows of prompts[0]
    expected = {}
    for p in prompts + extended:
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([p]), max_new_tokens=MAX_TOKENS, do_sample=False)
        expected[tuple(p)] = out[0, len(p) :].tolist()
    return prompts, extended, expected


def generate(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    return [o.outputs[0].token_ids for o in outs]


def check_engine(llm, workload, *, prefix_caching):
    prompts, extended, expected = workload
    assert generate(llm, prompts) == [expected[tuple(p)] for p in prompts]
    hits_before = llm.stats.state_snapshot_hits
    assert generate(llm, extended) == [expected[tuple(p)] for p in extended]
    stats = llm.stats
    if prefix_caching:
        assert stats.state_snapshots_taken > 0
        assert stats.state_snapshot_hits > hits_before and stats.prefix_cache_hits > 0
    else:
        assert stats.state_snapshots_taken == stats.state_snapshot_hits == stats.prefix_cache_hits == 0
    llm.engine.blocks.check_invariants()
    llm.engine.states.check_invariants()
    assert not llm.engine.states.live  # every sequence's slot was given back
    return stats


def test_engine_greedy_matches_transformers(models, workload):
    path, _ = models["g2"]
    llm = LLM(path, **ENGINE)
    assert llm.engine.runner.in_pass_capture
    inner = []
    forward = llm.engine.runner._forward
    llm.engine.runner._forward = lambda chunks, nd, plan, caps=(): (inner.append(any(caps)), forward(chunks, nd, plan, caps))[1]
    stats = check_engine(llm, workload, prefix_caching=True)
    assert any(inner)  # some capture rows fell inside a chunk and were taken by the layers
    # the extended prompts resumed after their 64 shared rows instead of recomputing them
    assert stats.prefill_tokens_computed < stats.prompt_tokens


def test_engine_without_prefix_caching(models, workload):
    path, _ = models["g2"]
    check_engine(LLM(path, enable_prefix_caching=False, **ENGINE), workload, prefix_caching=False)


def test_engine_splits_chunks_at_captures_when_a_layer_cannot_capture_in_pass(models, workload):
    """A layer answering supports_replay_tail_split False: every chunk is cut at its captures into
    consecutive passes; the outputs and the prefix hits stay."""

    class NoInPassCapture:
        @hookimpl(tryfirst=True)
        def supports_replay_tail_split(self, layer_kind):
            return False if layer_kind == "ssm.mamba2" else None

    path, _ = models["g2"]
    registry = get_registry()
    registry.add_plugin(NoInPassCapture(), name="no-in-pass-capture")
    try:
        llm = LLM(path, **ENGINE)
    finally:
        registry.remove_plugin("no-in-pass-capture")
    assert not llm.capabilities.replay_tail_split_supported and not llm.engine.runner.in_pass_capture
    passes = []
    forward = llm.engine.runner._forward
    llm.engine.runner._forward = lambda chunks, nd, plan, inner=(): (passes.append(any(inner)), forward(chunks, nd, plan, inner))[1]
    check_engine(llm, workload, prefix_caching=True)
    assert passes and not any(passes)  # no capture was handed to the layers
