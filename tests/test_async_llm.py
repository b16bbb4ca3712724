"""AsyncLLM: streaming, batching of concurrent requests, cancellation, aborts, errors, shutdown.

Every test drives a real (tiny) engine through the worker thread and compares tokens with the
synchronous `LLM.generate` on the same engine.
"""

import asyncio

import pytest

torch = pytest.importorskip("torch")

from layerzoo.entrypoints.async_llm import AsyncLLM, EngineDeadError  # noqa: E402
from layerzoo.errors import UserError  # noqa: E402
from layerzoo.llm import LLM  # noqa: E402
from layerzoo.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=8)
LONG = SamplingParams(temperature=0, max_tokens=500)  # far more steps than any test waits for
PROMPTS = ["t1 t2 t3", "t5 t6", "t9 t8 t7 t6 t5"]
ENGINE_ARGS = dict(dtype="float32", kv_cache_memory=1 << 20, max_model_len=1024)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a busy 2-core machine OpenMP spin-waits make tiny steps take seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # keeps LLM() from raising the thread count again
        yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llm(tiny_qwen3_dir):
    return LLM(tiny_qwen3_dir, **ENGINE_ARGS)


@pytest.fixture
def async_llm(llm):
    """An AsyncLLM over the module's engine; shut down (engine idle again) after the test."""
    engine = AsyncLLM.from_engine(llm.engine, llm.tokenizer)
    yield engine
    engine.shutdown()
    assert not llm.engine.has_unfinished() and not llm.engine.requests


@pytest.fixture
def batch_sizes(llm, monkeypatch):
    """The number of sequences that got a token in each engine step."""
    sizes, step = [], llm.engine.step

    def recording_step():
        updated = step()
        sizes.append(len(updated))
        return updated

    monkeypatch.setattr(llm.engine, "step", recording_step)
    return sizes


def run(coro, timeout: float = 15):
    """Run a coroutine on a fresh loop; a hang fails the test instead of stalling the suite."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def collect(stream):
    return [out async for out in stream]


async def engine_state(async_llm):
    """(unfinished work, free blocks, live request ids), read on the worker after earlier commands."""
    return await async_llm.call(lambda e: (e.has_unfinished(), e.blocks.num_free_blocks(), sorted(e.requests)))


def test_stream_grows_and_ends_with_the_tokens_of_generate(llm, async_llm):
    (ref,) = llm.generate(PROMPTS[0], GREEDY)
    outs = run(collect(async_llm.generate(PROMPTS[0], GREEDY, request_id="r")))

    assert len(outs) >= 2
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    final = outs[-1].outputs[0]
    assert (final.token_ids, final.text, final.finish_reason) == (ref.outputs[0].token_ids, ref.outputs[0].text, "length")
    for before, after in zip(outs, outs[1:]):
        a, b = before.outputs[0], after.outputs[0]
        assert len(a.token_ids) < len(b.token_ids) and b.token_ids[: len(a.token_ids)] == a.token_ids
        assert b.text.startswith(a.text)
    assert outs[0].request_id == "r" and outs[0].prompt == PROMPTS[0]


def test_text_that_may_start_a_stop_string_is_held_back(llm, async_llm):
    (plain,) = llm.generate(PROMPTS[0], GREEDY)
    words = plain.outputs[0].text.split()
    params = SamplingParams(temperature=0, max_tokens=8, stop=f" {words[3]} {words[4]}")
    (ref,) = llm.generate(PROMPTS[0], params)
    assert ref.outputs[0].finish_reason == "stop"  # else this test checks nothing

    outs = run(collect(async_llm.generate(PROMPTS[0], params)))

    final = outs[-1].outputs[0]
    assert (final.text, final.token_ids, final.finish_reason) == (ref.outputs[0].text, ref.outputs[0].token_ids, "stop")
    assert all(final.text.startswith(o.outputs[0].text) for o in outs)


def test_concurrent_requests_are_batched_and_match_generate(llm, async_llm, batch_sizes):
    refs = llm.generate(PROMPTS, GREEDY)
    batch_sizes.clear()

    async def main():
        return await asyncio.gather(*(collect(async_llm.generate(p, GREEDY)) for p in PROMPTS))

    streams = run(main())

    assert [s[-1].outputs[0].token_ids for s in streams] == [r.outputs[0].token_ids for r in refs]
    assert max(batch_sizes) == len(PROMPTS)


async def _cancel_consumer(async_llm):
    started = asyncio.Event()

    async def consume():
        async for _ in async_llm.generate(PROMPTS[0], LONG):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def _close_stream(async_llm):
    stream = await async_llm.add_request("r", PROMPTS[0], LONG)
    async for _ in stream:
        break
    await stream.aclose()


async def _drop_unstarted_stream(async_llm):
    stream = await async_llm.add_request("r", PROMPTS[0], LONG)
    del stream


@pytest.mark.parametrize("give_up", [_cancel_consumer, _close_stream, _drop_unstarted_stream])
def test_a_consumer_that_gives_up_aborts_its_request(llm, async_llm, give_up):
    free = llm.engine.blocks.num_free_blocks()

    async def main():
        await give_up(async_llm)
        return await engine_state(async_llm)

    assert run(main()) == (False, free, [])


def test_abort_ends_the_stream_with_finish_reason_abort(llm, async_llm):
    free = llm.engine.blocks.num_free_blocks()

    async def main():
        outs = []
        async for out in await async_llm.add_request("r", PROMPTS[0], LONG):
            outs.append(out)
            if len(outs) == 2:
                await async_llm.abort("r")
        return outs, await engine_state(async_llm)

    outs, state = run(main())

    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"
    assert 2 <= len(outs[-1].outputs[0].token_ids) < LONG.max_tokens
    assert state == (False, free, [])


def test_a_bad_prompt_fails_its_caller_only(llm, async_llm):
    (ref,) = llm.generate(PROMPTS[0], GREEDY)

    async def main():
        good = asyncio.create_task(collect(async_llm.generate(PROMPTS[0], GREEDY, request_id="good")))
        bad = [{"prompt_token_ids": []}, {"prompt_token_ids": [10**6]}, 42]
        errors = []
        for prompt in bad:
            with pytest.raises(UserError) as info:
                await async_llm.add_request("bad", prompt, GREEDY)
            errors.append(str(info.value))
        # an id in use: a request sure to be running still (8 tokens may end before this line)
        running = asyncio.create_task(collect(await async_llm.add_request("long", PROMPTS[2], LONG)))
        with pytest.raises(UserError, match="already in use"):
            await async_llm.add_request("long", PROMPTS[1], GREEDY)
        await async_llm.abort("long")
        assert (await running)[-1].outputs[0].finish_reason == "abort"
        return errors, await good

    errors, outs = run(main())

    assert "no tokens" in errors[0] and "token ids" in errors[1] and "prompt" in errors[2]
    assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids


def test_a_failed_step_reaches_every_stream_and_the_engine_recovers(llm, async_llm, monkeypatch):
    step, calls = llm.engine.step, []

    def failing_step():
        # Fail once, at the first step that holds both requests (however the worker interleaves).
        if not calls and len(llm.engine.requests) == 2:
            calls.append(1)
            raise RuntimeError("boom")
        return step()

    (ref,) = llm.generate(PROMPTS[1], GREEDY)
    monkeypatch.setattr(llm.engine, "step", failing_step)

    async def main():
        streams = [collect(async_llm.generate(p, LONG)) for p in PROMPTS[:2]]
        results = await asyncio.gather(*streams, return_exceptions=True)
        after = await collect(async_llm.generate(PROMPTS[1], GREEDY))
        return results, after, await engine_state(async_llm)

    results, after, state = run(main())

    assert [type(r) for r in results] == [RuntimeError, RuntimeError] and "boom" in str(results[0])
    assert after[-1].outputs[0].token_ids == ref.outputs[0].token_ids
    assert state[0] is False and state[2] == []


def test_shutdown_stops_the_worker_and_ends_live_streams(llm, async_llm):
    async def main():
        stream = await async_llm.add_request("r", PROMPTS[0], LONG)
        first = await anext(stream)
        async_llm.shutdown()
        with pytest.raises(EngineDeadError):
            await collect(stream)
        with pytest.raises(EngineDeadError):
            await async_llm.add_request("s", PROMPTS[0], GREEDY)
        return first

    first = run(main())

    assert not first.finished and not async_llm.is_running and not async_llm._worker.is_alive()
    assert not llm.engine.has_unfinished() and not llm.engine.requests


def test_constructor_loads_like_llm(llm, tiny_qwen3_dir):
    (ref,) = llm.generate(PROMPTS[2], GREEDY)
    with pytest.raises(UserError, match="unknown argument"):
        AsyncLLM(tiny_qwen3_dir, bogus=1)
    engine = AsyncLLM(tiny_qwen3_dir, **ENGINE_ARGS)
    try:
        outs = run(collect(engine.generate(PROMPTS[2], GREEDY)))
    finally:
        engine.shutdown()
    assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids
    assert engine.stats.generated_tokens == GREEDY.max_tokens


def test_a_request_that_outgrows_the_whole_cache_ends_with_length(tiny_qwen3_dir):
    """The scheduler finishes it inside ``schedule()``; its final output must still be published
    (it hung forever before), as synchronous ``generate`` returns it. An engine now refuses to start
    with a cache that cannot hold one ``max_model_len`` sequence, so the scheduler is given a longer
    limit than its cache holds after start, the state this path guards against."""
    import attrs

    small = LLM(tiny_qwen3_dir, dtype="float32", kv_cache_memory=256 * 16 * 4, max_model_len=64)  # 4 blocks of 16
    assert small.engine.blocks.num_blocks == 4
    scheduler = small.engine.scheduler
    scheduler.config = attrs.evolve(scheduler.config, max_model_len=1000)
    prompt = {"prompt_token_ids": list(range(1, 41))}
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    (sync,) = small.generate(prompt, params)
    assert sync.outputs[0].finish_reason == "length" and len(sync.outputs[0].token_ids) < 100
    engine = AsyncLLM.from_engine(small.engine, small.tokenizer)
    try:
        outs = run(collect(engine.generate(prompt, params, request_id="big")), timeout=30)
    finally:
        engine.shutdown()
    assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "length"
    assert outs[-1].outputs[0].token_ids == sync.outputs[0].token_ids
