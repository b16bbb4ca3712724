"""Captured decode on a Gated DeltaNet hybrid (Qwen3.5 layout: GDN and gated attention, dense MLP),
on CPU with ``compile_decode=True``: the same greedy tokens as eager decode, with padded rows
routed to the state pool's scratch slot, and the recurrent states of live sequences untouched by
the captures themselves."""

from __future__ import annotations

from layerzoo import LLM, SamplingParams

PROMPTS = [[3, 14, 15, 9, 2, 6, 5, 35, 8], [9, 7, 9, 3, 2, 38, 4, 6, 26, 43, 3], [2, 7, 18, 28, 18]]


def tokens(llm, prompts, max_tokens: int) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]


def test_captured_decode_matches_eager_on_a_hybrid(qwen3_5_tiny):
    path, _ = qwen3_5_tiny
    args = dict(dtype="float32", max_num_seqs=4, max_model_len=256)
    eager = LLM(path, **args)
    expected = tokens(eager, PROMPTS, 10)
    llm = LLM(path, compile_decode=True, **args)
    # Three sequences in the bucket of four (one padded row) for all nine decode steps: one compile.
    assert tokens(llm, PROMPTS, 10) == expected
    graphs = llm.stats.graphs
    assert graphs["eager"] == 0 and graphs["replays"] == 9 and graphs["captures"] == 1
    assert llm.engine.runner.decode_capture.summary() == {"artifacts": 1, "compiles": 1}
    pool = llm.engine.runner.pool
    scratch = pool.pad_slot
    assert any(pool.recurrent[i][scratch].abs().sum() > 0 for i in pool.layers)  # padded rows wrote there
    llm.engine.states.check_invariants()
