"""Checks of MTP drafting (``speculative_config={"method": "mtp"}``) for any architecture whose
plugin serves a head; the plugins' tests call them on tiny random checkpoints with a head written
by `layerzoo.testing.checkpoints.add_mtp_head`.

- `greedy_equals_plain`: greedy outputs with MTP speculation equal plain decoding, for prompts of
  several lengths, batched, with ``n > 1``, chunked prompts and preemptions (a small cache), then
  again over a warm prefix cache.
- `drafts_equal_recompute`: the drafts the head made while generating (its KV kept up step by step
  through prefills, verifies with rejected drafts and chained rows) equal the drafts it makes
  after one prefill of the same tokens: the head's KV in the pool is what a recompute gives; with
  ``pause``, also after steps in which the head did not run and the rows waited.
- `head_runs_only_when_asked`: adaptive MTP with a head that is rarely right runs the head for a
  decoding sequence only in steps whose schedule asked for its drafts, in few of the steps.
"""

from __future__ import annotations

import random

from layerzoo import LLM, SamplingParams


def _run(llm, prompts, params):
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [[c.token_ids for c in o.outputs] for o in outs]


def mtp_config(k: int = 3, adaptive: bool = False) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "adaptive": adaptive}


def prompts_for(vocab: int, lengths, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def small_cache(path, blocks: int = 12, k: int = 3) -> int:
    """``kv_cache_memory`` bytes for ``blocks`` blocks of 16 tokens of the model with its MTP head
    (and its recurrent-state pool): room for each prompt, not for all of them at once."""
    from layerzoo.engine_args import EngineArgs
    from layerzoo.loading.model_loading import load_model
    from layerzoo.runtime.state_ledger import StateConfig
    from layerzoo.runtime.state_pool import StatePool

    model = load_model(path, EngineArgs(speculative_config=mtp_config(k))).model
    per_token = sum(s.bytes_per_token for s in model.kv_cache_specs().values())
    specs = model.state_specs()
    slots = StateConfig(max_seqs=4, draft_slots_per_seq=k).num_slots
    return per_token * 16 * blocks + (StatePool.bytes_for(specs, slots) if specs else 0)


def greedy_equals_plain(path, vocab: int, *, k: int = 3) -> LLM:
    """Assert greedy MTP outputs equal plain ones; returns the MTP engine's LLM (for its stats)."""
    prompts = prompts_for(vocab, (37, 5, 61, 12))
    greedy = SamplingParams(temperature=0, max_tokens=18, ignore_eos=True)
    pair = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, n=2)
    plain = LLM(path, dtype="float32")
    base, base_n = _run(plain, prompts, greedy), _run(plain, prompts[:2], pair)
    small = dict(max_num_batched_tokens=24, max_num_seqs=4, max_model_len=160, kv_cache_memory=small_cache(path, k=k))
    llm = LLM(path, dtype="float32", speculative_config=mtp_config(k), **small)
    assert _run(llm, prompts, greedy) == base
    assert _run(llm, prompts[:2], pair) == base_n
    warm = [p + [1, 2, 3] for p in prompts[:2]]  # shares the cached prompts' blocks
    assert _run(llm, warm, greedy) == _run(plain, warm, greedy)
    # The default adaptive policy (shadow checks of the head's drafts) changes work, not outputs:
    # the head skips sequences that do not draft, whose rows wait, through the same preemptions,
    # chunked prompts, forks and cached prefixes. Against plain decoding with the same limits: a
    # prompt split into chunks may round differently (GLM-5's sparse top-k at near ties).
    adaptive = LLM(path, dtype="float32", speculative_config=mtp_config(k, adaptive=True), **small)
    plain_small = LLM(path, dtype="float32", **small)
    assert _run(adaptive, prompts, greedy) == _run(plain_small, prompts, greedy)
    assert _run(adaptive, prompts[:2], pair) == _run(plain_small, prompts[:2], pair)
    assert _run(adaptive, warm, greedy) == _run(plain_small, warm, greedy)
    assert adaptive.engine.stats.preemptions > 0
    # Sampled requests verify the head's drafts by rejection sampling: they run to their length.
    sampled = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, ignore_eos=True, seed=3)
    assert all(len(c) == 12 for out in _run(llm, prompts, sampled) for c in out)
    return llm


def drafts_equal_recompute(path, vocab: int, k: int = 3, pause: range = range(0)) -> int:
    """Assert the stored drafts along a generation equal those after a fresh prefill of the same
    tokens; returns how many were compared. In the steps ``pause`` (counted from 0, the prompt's
    first) the head does not run for the sequence, as if its schedule had not asked: its rows wait
    and run with the next ones (drafts made after the pause must equal the recompute's too)."""
    prompt = prompts_for(vocab, (29,), seed=1)[0]
    params = SamplingParams(temperature=0, max_tokens=14 + len(pause), ignore_eos=True)
    llm = LLM(path, dtype="float32", speculative_config=mtp_config(k), max_num_batched_tokens=16)
    made = record_drafts(llm)
    if pause:
        _pause(llm, pause)
    output = _run(llm, [prompt], params)[0][0]
    assert any(len(d) == k for _, d in made), made  # chained rows got their reserved blocks
    tokens = prompt + output
    fresh = LLM(path, dtype="float32", speculative_config=mtp_config(k))
    fresh_made = record_drafts(fresh)
    compared = 0
    for length, drafts in made:
        if length > len(tokens) or length <= len(prompt):
            continue
        fresh_made.clear()
        _run(fresh, [tokens[: length - 1]], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
        assert fresh_made[-1][0] == length, fresh_made
        # As many as the step asked for (fewer near max_tokens): a prefix of the recompute's k.
        assert drafts and drafts == fresh_made[-1][1][: len(drafts)], (length, drafts, fresh_made[-1][1])
        compared += 1
    return compared


def _pause(llm, steps: range) -> None:
    """The head does not run for any decoding sequence in the drafter's ``steps``."""
    drafter = llm.engine.runner.mtp
    proposer, draft, step = drafter.proposer, drafter.draft, [0]
    asked = proposer.drafts_now

    def paused(plan, tokens, kept_rows):
        proposer.drafts_now = (lambda seq_id: False) if step[0] in steps else asked
        step[0] += 1
        draft(plan, tokens, kept_rows)

    drafter.draft = paused


def head_runs_only_when_asked(path, vocab: int, k: int = 1) -> tuple[int, int]:
    """Assert adaptive MTP runs the head for a decoding sequence only in a step whose schedule asked
    for its drafts, chaining no more drafts than it asked for, with outputs equal to plain
    decoding; returns ``(steps that ran the head, steps)``, for the caller's bound (a head that is
    rarely right: few)."""
    prompts = prompts_for(vocab, (21, 9, 33), seed=2)
    params = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    llm = LLM(path, dtype="float32", speculative_config=mtp_config(k, adaptive=True))
    drafter = llm.engine.runner.mtp
    proposer, run, ran = drafter.proposer, drafter._draft, []

    def checked(plan, groups):
        prompt_rows = {c.seq_id for c in plan.prefills}
        for g in groups:
            assert g.seq_id in prompt_rows or proposer.drafts_now(g.seq_id), (g.seq_id, proposer.asked)
        ran.append(len(groups))
        return run(plan, groups)

    store = proposer.store

    def stored(seq_id, length, drafts):
        assert len(drafts) <= proposer.wanted(seq_id), (seq_id, drafts, proposer.asked)
        store(seq_id, length, drafts)

    drafter._draft, proposer.store = checked, stored
    steps = llm.engine.stats.steps
    assert _run(llm, prompts, params) == _run(LLM(path, dtype="float32"), prompts, params)
    return len(ran), llm.engine.stats.steps - steps


def record_drafts(llm) -> list[tuple[int, list[int]]]:
    """Every ``(length, drafts)`` the engine's MTP proposer stores, in order."""
    proposer = llm.engine.runner.mtp.proposer
    made, store = [], proposer.store

    def recording(seq_id, length, drafts):
        made.append((length, list(drafts)))
        store(seq_id, length, drafts)

    proposer.store = recording
    return made
