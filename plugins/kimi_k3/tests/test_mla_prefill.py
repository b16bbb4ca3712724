"""MLA's two prefill strategies on Kimi Linear: the paged one (default) and the chunk-local one
(``mla_prefill="local"``), and the engine's gating of the local one: no prefix matching, no
chunking, no forked tails for n > 1 siblings, no verifies past position 0, and rollbacks that
never re-run several rows past position 0."""

import logging

import pytest
import torch

from layerzoo import LLM, SamplingParams
from layerzoo.engine_args import EngineArgs
from layerzoo.errors import UserError
from layerzoo.loading.model_loading import load_model
from layerzoo.testing import prefill_logits

MLA_LAYER = 2  # 0-based index of the tiny config's one MLA layer (full_attn_layers [3])
PROMPT_LEN, KEEP, MAX_TOKENS = 50, 6, 12



class Boundaries:
    """Rollback-ring entries before the positions ``before(seq, position)`` picks."""

    def __init__(self, before):
        self.before = before


def greedy(max_tokens=MAX_TOKENS, n=1):
    return SamplingParams(n=n, temperature=0, max_tokens=max_tokens, ignore_eos=True)


def hf_greedy(model, prompt, steps=MAX_TOKENS):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=steps, do_sample=False, min_new_tokens=steps)
    return out[0, len(prompt):].tolist()


def prompt_of(vocab, n=PROMPT_LEN, seed=1):
    return [(i * 7 + seed) % vocab for i in range(n)]


def test_strategies_agree_on_prompts_that_fit_one_chunk(kimi_tiny):
    path, hf_model = kimi_tiny
    ids = torch.tensor(prompt_of(hf_model.config.vocab_size, 70))
    paged = prefill_logits(load_model(path).model, ids, [70])
    local_model = load_model(path, EngineArgs(mla_prefill="local")).model
    assert local_model.layers[MLA_LAYER].self_attn.prefill == "local"
    torch.testing.assert_close(prefill_logits(local_model, ids, [70]), paged, atol=1e-5, rtol=0)
    prompts = [prompt_of(hf_model.config.vocab_size, n, seed=n) for n in (70, 5, 33)]
    outs = {}
    for strategy in ("paged", "local"):
        llm = LLM(path, dtype="float32", mla_prefill=strategy)
        outs[strategy] = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], greedy())]
    assert outs["local"] == outs["paged"] == [hf_greedy(hf_model, p) for p in prompts]


def test_mla_prefill_is_checked():
    with pytest.raises(UserError, match="mla_prefill"):
        EngineArgs(mla_prefill="chunky")


def test_local_prefill_turns_prefix_matching_and_chunking_off(kimi_tiny, monkeypatch):
    path, _ = kimi_tiny
    paged = LLM(path, dtype="float32").engine
    assert paged.blocks.enable_prefix_caching and paged.scheduler.chunked_prefill
    local = LLM(path, dtype="float32", mla_prefill="local").engine
    caps = local.model.capabilities
    assert caps.layers[MLA_LAYER].uses_local_mla_prefill and not caps.layers[0].uses_local_mla_prefill
    assert not local.blocks.enable_prefix_caching and not local.scheduler.chunked_prefill
    assert any(f"layer {MLA_LAYER} (MlaDecoderLayer)" in d and "prefix-cache matching" in d for d in local.stats.disabled_features)
    monkeypatch.setenv("LAYERZOO_MLA_PREFIX_SKIP", "1")
    accepted = LLM(path, dtype="float32", mla_prefill="local").engine
    assert accepted.blocks.enable_prefix_caching and not accepted.scheduler.chunked_prefill


def test_local_prefill_whole_prompts_beyond_the_token_budget(kimi_tiny):
    """A prompt longer than max_num_batched_tokens still runs whole (alone in its step)."""
    path, hf_model = kimi_tiny
    prompt = prompt_of(hf_model.config.vocab_size, 90)
    llm = LLM(path, dtype="float32", mla_prefill="local", max_num_batched_tokens=32)
    (out,) = llm.generate([{"prompt_token_ids": prompt}], greedy())
    assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt)


def test_local_prefill_siblings_do_not_prefill_a_forked_tail(kimi_tiny, caplog):
    path, hf_model = kimi_tiny
    prompt = prompt_of(hf_model.config.vocab_size, 40)
    with caplog.at_level(logging.WARNING, logger="layerzoo.runtime.scheduler"):
        llm = LLM(path, dtype="float32", mla_prefill="local")
        (out,) = llm.generate([{"prompt_token_ids": prompt}], greedy(n=3))
    expected = hf_greedy(hf_model, prompt)
    assert [c.token_ids for c in out.outputs] == [expected] * 3
    assert any("n > 1 siblings" in r.message and f"layer {MLA_LAYER} (MlaDecoderLayer)" in r.message for r in caplog.records)
    assert llm.stats.prefill_tokens_computed == 3 * len(prompt)  # each sibling prefilled the whole prompt


def test_local_prefill_refuses_verifies_past_position_0(kimi_tiny, caplog):
    path, hf_model = kimi_tiny
    prompt = [3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "adaptive": False}
    with caplog.at_level(logging.WARNING, logger="layerzoo.runtime.scheduler"):
        local = LLM(path, dtype="float32", mla_prefill="local", speculative_config=spec)
        (out,) = local.generate([{"prompt_token_ids": prompt}], greedy())
    assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt)
    assert local.stats.spec_verify_steps == 0
    assert any("speculative verify" in r.message and f"layer {MLA_LAYER}" in r.message for r in caplog.records)
    paged = LLM(path, dtype="float32", speculative_config=spec)
    (out,) = paged.generate([{"prompt_token_ids": prompt}], greedy())
    assert out.outputs[0].token_ids == hf_greedy(hf_model, prompt) and paged.stats.spec_verify_steps > 0


@pytest.mark.parametrize("strategy", ["paged", "local"])
def test_rollback_to_a_ring_snapshot_before_the_last_token(kimi_tiny, strategy):
    """The KDA ring snapshot lies 4 tokens before the rollback point: the paged strategy re-runs
    those rows over the cached latents; the local one cannot, and recomputes from position 0."""
    path, hf_model = kimi_tiny
    prompt = prompt_of(hf_model.config.vocab_size)
    P = PROMPT_LEN + KEEP
    llm = LLM(path, dtype="float32", mla_prefill=strategy)
    engine = llm.engine
    engine.scheduler.boundaries = Boundaries(lambda s, pos: pos == PROMPT_LEN + 1)
    (seq,) = engine.add_request("r", prompt, greedy())
    while len(seq.output_token_ids) < KEEP + 3:
        engine.step()
    engine.scheduler.rollback_to_boundary(seq, P)
    engine.outputs.reset(seq, engine.tokenizer.decode(seq.output_token_ids))
    assert seq.num_cached == (PROMPT_LEN + 1 if strategy == "paged" else 0)
    engine.scheduler.boundaries = None
    engine.run_until_done()
    assert seq.output_token_ids == hf_greedy(hf_model, prompt)
    engine.release("r")
