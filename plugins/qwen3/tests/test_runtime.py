"""Qwen3 and Qwen3-MoE on the paged runtime: batched, chunked, preempted and prefix-cached
generation gives exactly what transformers gives for each request alone."""

import random

import pytest
import torch

from layerzoo import LLM, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def hf_greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids).logits[0, -1].argmax().view(1, 1)], dim=1)
    return ids[0, len(prompt) :].tolist()


def workload(vocab, seed=0):
    """16 requests of different lengths; half share a 40-token prefix, two are identical."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(40)]
    prompts = [(shared if i % 2 else []) + [rng.randrange(vocab) for _ in range(rng.randrange(1, 70))] for i in range(15)]
    return prompts + [list(prompts[1])]


@pytest.fixture(scope="module", params=["dense", "moe"])
def case(request, tiny_models):
    path, hf_model = tiny_models[request.param]
    prompts = workload(hf_model.config.vocab_size)
    expected = [hf_greedy(hf_model, p, GREEDY.max_tokens) for p in prompts]
    return path, prompts, expected


def kv_bytes(path, tokens):
    """A KV budget of about ``tokens`` tokens for the model at ``path``."""
    from layerzoo.loading.model_loading import load_model

    specs = load_model(path).model.kv_cache_specs()
    return tokens * sum(s.bytes_per_token for s in specs.values())


def generate(path, prompts, **engine_args):
    llm = LLM(path, dtype="float32", **engine_args)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    llm.engine.blocks.check_invariants()
    assert llm.engine.blocks.num_free_blocks() == llm.engine.blocks.num_blocks  # nothing leaked
    return [o.outputs[0].token_ids for o in outs], llm.stats


def test_batched_matches_transformers(case):
    path, prompts, expected = case
    tokens, stats = generate(path, prompts, max_num_batched_tokens=2048)
    assert tokens == expected
    assert stats.prefix_cache_hits == 0  # all admitted in one step: nothing was cached yet


def test_chunked_prefill_matches(case):
    path, prompts, expected = case
    tokens, stats = generate(path, prompts, max_num_batched_tokens=13)
    assert tokens == expected
    assert stats.prefix_cache_hits > 0  # later requests found the shared prefix


def test_preemption_matches(case):
    path, prompts, expected = case
    tokens, stats = generate(path, prompts, kv_cache_memory=kv_bytes(path, 200), max_num_batched_tokens=64, max_model_len=192)
    assert tokens == expected
    assert stats.preemptions > 0


def test_few_sequences_at_a_time_with_prefix_hits(case):
    path, prompts, expected = case
    tokens, stats = generate(path, prompts, max_num_seqs=3, block_size=8)
    assert tokens == expected
    assert stats.prefix_cache_hits > 0


def test_permutation_and_repetition_change_nothing(case):
    path, prompts, expected = case
    order = list(range(len(prompts)))
    random.Random(1).shuffle(order)
    tokens, _ = generate(path, [prompts[i] for i in order], max_num_batched_tokens=29)
    assert [tokens[order.index(i)] for i in range(len(prompts))] == expected
    again, _ = generate(path, [prompts[i] for i in order], max_num_batched_tokens=29)
    assert again == tokens


def test_n_completions_share_the_prompt(tiny_models):
    path, _ = tiny_models["dense"]
    llm = LLM(path, dtype="float32", block_size=4)
    prompt = {"prompt_token_ids": list(range(3, 30))}
    (out,) = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True))
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # independent draws
    # The first completion computes the 27 prompt tokens; the others reuse its 6 full blocks
    # and compute only the 3 tokens of the partial block.
    assert llm.stats.prefill_tokens_computed == 27 + 2 * 3
    (again,) = LLM(path, dtype="float32", block_size=4).generate(
        prompt, SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=8, ignore_eos=True)
    )
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]


def test_seeded_sampling_is_the_same_alone_and_batched(tiny_models):
    path, hf_model = tiny_models["dense"]
    vocab = hf_model.config.vocab_size
    prompts = [{"prompt_token_ids": [i % vocab for i in range(5, 5 + n)]} for n in (4, 17, 9)]
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=10, ignore_eos=True)
    alone = LLM(path, dtype="float32").generate(prompts[1], params)[0].outputs[0].token_ids
    batched = LLM(path, dtype="float32").generate(prompts, params)[1].outputs[0].token_ids
    assert alone == batched


def test_logprobs_and_metrics(tiny_models):
    path, hf_model = tiny_models["dense"]
    prompt = list(range(1, 12))
    (out,) = LLM(path, dtype="float32").generate(
        {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3, logprobs=2, ignore_eos=True)
    )
    completion = out.outputs[0]
    with torch.no_grad():
        first = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, -1], -1)
    assert completion.token_ids[0] == int(first.argmax())
    assert abs(completion.logprobs[0][completion.token_ids[0]] - float(first.max())) < 1e-4
    assert len(completion.logprobs) == 3 and all(len(entry) in (2, 3) for entry in completion.logprobs)
    assert out.metrics["time_to_first_token_s"] >= 0 and out.metrics["total_s"] >= out.metrics["time_to_first_token_s"]


def test_per_sequence_decode_when_a_layer_declines_batching(case, caplog):
    """A layer answering decode_multi_seq_unsupported gets one pass per decode row, and the
    prefill chunks in a pass of their own; outputs stay the same."""
    from layerzoo import hookimpl
    from layerzoo.plugins.manager import get_registry

    class NoBatchedDecode:
        @hookimpl(tryfirst=True)
        def decode_multi_seq_unsupported(self, layer_kind):
            return True if layer_kind.startswith("qwen3") else None

    caplog.set_level("INFO")
    path, prompts, expected = case
    registry = get_registry()
    registry.add_plugin(NoBatchedDecode(), name="no-batched-decode")
    try:
        llm = LLM(path, dtype="float32", max_num_batched_tokens=40)
    finally:
        registry.remove_plugin("no-batched-decode")
    runner = llm.engine.runner
    assert runner.per_sequence_decode
    assert "batched multi-sequence decode is off: layer 0" in caplog.text
    widths = []
    forward = runner._forward
    runner._forward = lambda chunks, num_decodes, *rest: (widths.append((len(chunks), num_decodes)), forward(chunks, num_decodes, *rest))[1]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert all(n == 1 for n, decodes in widths if decodes)  # never two decode rows in one pass
    assert all(decodes == 0 for n, decodes in widths if n > 1)  # prefill chunks run apart


def test_decode_steps_go_through_the_graph_bookkeeping(case):
    path, prompts, expected = case
    llm = LLM(path, dtype="float32", kv_cache_memory=kv_bytes(path, 200), max_num_batched_tokens=64, max_model_len=192)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    graphs = llm.stats.graphs
    # CPU decode runs eagerly unless compile_decode=True (tests/test_decode_graphs.py), through the same bookkeeping
    assert graphs["eager"] > 0 and graphs["eager_reasons"] == {"decode compile off on cpu (compile_decode=False)": graphs["eager"]}
    runner = llm.engine.runner
    assert runner.slots.slot_of == {} and sorted(runner.slots.unused) == list(range(runner.slots.max_slots))


def test_local_mla_prefill_turns_prefix_matching_and_chunking_off(case, caplog, monkeypatch):
    """A layer whose prefill sees only its chunk: no prefix matches, prompts run whole, logged once
    with the layer; LAYERZOO_MLA_PREFIX_SKIP=1 accepts prefix matching again."""
    from layerzoo import hookimpl
    from layerzoo.plugins.manager import get_registry

    class LocalPrefill:
        @hookimpl(tryfirst=True)
        def uses_local_mla_prefill(self, layer_kind):
            return True if layer_kind.startswith("qwen3") else None

    path, prompts, expected = case
    registry = get_registry()
    registry.add_plugin(LocalPrefill(), name="local-prefill")
    try:
        llm = LLM(path, dtype="float32", max_num_batched_tokens=13)
        monkeypatch.setenv("LAYERZOO_MLA_PREFIX_SKIP", "1")
        skipping = LLM(path, dtype="float32", max_num_batched_tokens=13)
    finally:
        registry.remove_plugin("local-prefill")
    assert "prefix caching is off: prefix-cache matching is off: layer 0" in caplog.text
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert llm.stats.prefix_cache_hits == 0 and not llm.engine.blocks.enable_prefix_caching
    assert llm.stats.prefill_tokens_computed == sum(map(len, prompts))  # whole prompts, none reused
    assert not llm.engine.scheduler.chunked_prefill
    assert skipping.engine.blocks.enable_prefix_caching and not skipping.engine.scheduler.chunked_prefill
