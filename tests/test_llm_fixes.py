"""LLM.stream and AsyncLLM: text reaches its own request whoever steps the engine; n > 1 is
refused by stream(); a cancelled async stream's request id can be reused at once."""

import asyncio

import pytest

torch = pytest.importorskip("torch")

from layerzoo.entrypoints.async_llm import AsyncLLM  # noqa: E402
from layerzoo.errors import UserError  # noqa: E402
from layerzoo.llm import LLM  # noqa: E402
from layerzoo.sampling import SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_qwen3_dir):
    torch.set_num_threads(1)
    return LLM(tiny_qwen3_dir, dtype="float32", max_model_len=256)


def engine_idle(llm) -> bool:
    """Nothing running, no request held, every KV block and decode slot back."""
    e = llm.engine
    return (
        not e.has_unfinished() and not e.requests and e.blocks.num_free_blocks() == e.blocks.num_blocks
        and not e.runner.slots.slot_of
    )


def test_a_paused_stream_gets_its_rest_after_generate_ran_the_engine(llm):
    (ref,) = llm.generate("t1 t2 t3", GREEDY)
    stream = llm.stream("t1 t2 t3", GREEDY)
    first = next(stream)
    llm.generate("t5 t6", GREEDY)  # steps the paused stream's request to its end too
    assert first + "".join(stream) == ref.outputs[0].text
    assert engine_idle(llm)


def test_two_streams_read_with_zip_lose_nothing(llm):
    refs = llm.generate(["t1 t2 t3", "t9 t8"], [GREEDY, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)])
    a = llm.stream("t1 t2 t3", GREEDY)
    b = llm.stream("t9 t8", SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    got_a, got_b = [], []
    # b ends first (each read steps both requests); zip reads b first, so no piece of a is dropped
    for y, x in zip(b, a):
        got_b.append(y)
        got_a.append(x)
    got_b += list(b)
    got_a += list(a)
    assert "".join(got_a) == refs[0].outputs[0].text
    assert "".join(got_b) == refs[1].outputs[0].text
    assert engine_idle(llm)


def test_stream_refuses_n_above_one_and_leaves_nothing_running(llm):
    with pytest.raises(UserError, match="sampling_params.n"):
        next(llm.stream("t1 t2", SamplingParams(n=3, max_tokens=8)))
    assert engine_idle(llm)


def test_a_cancelled_stream_id_can_be_reused_at_once(llm):
    async def main():
        engine = AsyncLLM.from_engine(llm.engine, llm.tokenizer)
        try:
            long = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
            stream = await engine.add_request("same", "t1 t2", long)
            started = asyncio.Event()

            async def consume():
                async for _ in stream:
                    started.set()

            task = asyncio.create_task(consume())
            await started.wait()
            task.cancel()  # its abort runs only on the task's next turn
            outs = [o async for o in await engine.add_request("same", "t1 t2 t3", GREEDY)]
            with pytest.raises(asyncio.CancelledError):
                await task
            return outs[-1]
        finally:
            engine.shutdown()

    last = asyncio.run(asyncio.wait_for(main(), 30))
    (ref,) = llm.generate("t1 t2 t3", GREEDY)
    assert last.finished and last.outputs[0].token_ids == ref.outputs[0].token_ids
    assert engine_idle(llm)
