"""The asyncio front end the HTTP server uses, shaped like vLLM's ``AsyncLLM``.

One background worker thread owns the `LLMEngine`: model steps are blocking torch calls, so they
cannot run on the event loop, and the engine is not thread-safe, so nothing else may touch it.
Every engine call (adding, aborting, stepping, releasing) is a command the worker runs between
steps; callers on any event loop submit commands and await their results. The worker steps while
any request is unfinished and sleeps on a condition otherwise, so all live requests share each
step's batch.

Each request streams cumulative `RequestOutput` snapshots through an ``asyncio.Queue`` on its
caller's loop (filled with ``loop.call_soon_threadsafe``). A consumer that falls behind gets the
newest snapshot only, as vLLM's output collector does. A consumer that stops iterating (closes the
stream, or its task is cancelled, e.g. when an HTTP client disconnects) aborts its request, so the
engine frees its blocks.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

from layerzoo.errors import LayerzooError, UserError
from layerzoo.llm import LLM, RequestOutput, check_params, check_stop_strings, embedding_output, prompt_tokens, request_output
from layerzoo.runtime.engine import EngineStats, LLMEngine
from layerzoo.runtime.pooling import EmbeddingRequestOutput, PoolingParams
from layerzoo.runtime.sequence import Sequence
from layerzoo.sampling import SamplingParams
from layerzoo.tokenization.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineDeadError(LayerzooError):
    """The engine's worker has stopped (shut down, or broken by an error it could not recover from)."""


class _Stream:
    """One request's path from the worker thread to the event loop of the caller that reads it.

    The worker side (``seqs``, ``holdback``, ``sent``) is touched only by the worker thread; the
    consumer side (``queue``, ``closed``) only by the caller's loop.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self.seqs: list[Sequence] = []
        self.holdback = 0  # characters that could still start a stop string
        self.sent = -1  # output tokens in the last snapshot sent
        self.closed = False  # the consumer saw the last item, or gave up on the request
        self.consumer: asyncio.Task | None = None  # the task iterating the stream (consumer side)

    def abandoned(self) -> bool:
        """Whether the consumer gave up, or is giving up: its task is cancelled or done (consumer side).

        A cancelled task runs the stream's ``finally`` (which aborts) only on its next turn; a
        request id reused before then must not be refused as "in use".
        """
        task = self.consumer
        return self.closed or (task is not None and (task.done() or task.cancelling() > 0))

    def put(self, item: RequestOutput | BaseException) -> bool:
        """Hand an item to the consumer's loop (worker thread); False when that loop is closed."""
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:
            return False
        return True

    async def get(self) -> RequestOutput:
        """The newest snapshot (older ones still queued are skipped); raises a delivered error."""
        item = await self.queue.get()
        while not isinstance(item, BaseException) and not self.queue.empty():
            item = self.queue.get_nowait()
        if isinstance(item, BaseException):
            self.closed = True
            raise item
        self.closed = item.finished
        return item

    def snapshot(self) -> RequestOutput | EmbeddingRequestOutput:
        """The request's output so far (worker thread); unfinished text stops short of the holdback.
        A pooling request's is its embedding (None until its prompt has run)."""
        if self.seqs[0].pools:
            self.sent = 0
            return embedding_output(self.seqs[0])
        out = request_output(self.seqs)
        for completion, seq in zip(out.outputs, self.seqs):
            if not seq.finished and self.holdback:
                completion.text = completion.text[: max(0, len(completion.text) - self.holdback)]
            seq.num_text_sent = len(completion.text)  # the loop watchdog must not rewind sent text
        self.sent = sum(len(s.output_token_ids) for s in self.seqs)
        return out


class AsyncLLM:
    """A model served to asyncio callers; every request streams `RequestOutput` snapshots.

    Args: as `layerzoo.llm.LLM` (the model is loaded the same way). `from_engine` wraps an engine
    that is already built. Call `shutdown` when done: it stops the worker thread.
    """

    def __init__(
        self,
        model: str | Path | None = None,
        dtype: Any = "auto",
        *,
        revision: str | None = None,
        device: str = "cpu",
        seed: int = 0,
        **engine_args: Any,
    ):
        llm = LLM(model, dtype, revision=revision, device=device, seed=seed, **engine_args)
        self._start(llm.engine, llm.tokenizer)

    @classmethod
    def from_engine(cls, engine: LLMEngine, tokenizer: Tokenizer) -> AsyncLLM:
        """Serve an engine built elsewhere (tests, or a caller that configured it itself)."""
        self = cls.__new__(cls)
        self._start(engine, tokenizer)
        return self

    def _start(self, engine: LLMEngine, tokenizer: Tokenizer) -> None:
        self.engine, self.tokenizer = engine, tokenizer
        self._cond = threading.Condition()
        self._commands: list[Callable[[], None]] = []
        self._stopped: EngineDeadError | None = None  # set once no more commands are accepted
        self._streams: dict[str, _Stream] = {}  # live requests (worker thread only)
        self._by_id: dict[str, _Stream] = {}  # the newest stream handed out under each id (callers' side)
        self._worker = threading.Thread(target=self._run, name="layerzoo-engine", daemon=True)
        self._worker.start()

    @property
    def stats(self) -> EngineStats:
        return self.engine.stats

    @property
    def is_running(self) -> bool:
        """Whether the worker still accepts requests."""
        return self._stopped is None

    # -- the caller's side -------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: str | dict, params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Queue a request; returns the stream of its outputs.

        A bad prompt or a request id in use raises `UserError` here, before any streaming. Each
        snapshot holds the text and token ids so far; the last has ``finished=True`` and the
        finish reasons. Stop iterating early (or cancel the task) to abort the request.
        """
        check_params(params, "params")
        if not isinstance(request_id, str) or not request_id:
            raise UserError(f"request_id: expected a non-empty string, got {request_id!r}")
        old = self._by_id.get(request_id)
        if old is not None and old.abandoned():
            self._cancel(old)  # queued before the add below, so the id is free when the add runs
        stream = _Stream(request_id, asyncio.get_running_loop())
        self._by_id[request_id] = stream
        try:
            await self.call(lambda engine: self._add(stream, prompt, params))
        except BaseException:
            self._cancel(stream)  # cancelled while queued: the add may still run
            raise
        outputs = self._outputs(stream)
        # A stream dropped before its first iteration never runs its finally; abort it then.
        weakref.finalize(outputs, self._cancel, stream).atexit = False
        return outputs

    async def generate(
        self, prompt: str | dict, params: SamplingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[RequestOutput]:
        """`add_request` and iterate in one call (vLLM's ``generate``); the id defaults to a fresh one."""
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        async with aclosing(await self.add_request(request_id, prompt, params or SamplingParams())) as outputs:
            async for out in outputs:
                yield out

    async def add_pooling_request(self, request_id: str, prompt: str | dict, pooling: PoolingParams) -> AsyncIterator[EmbeddingRequestOutput]:
        """Queue an embedding request (`LLMEngine.add_pooling_request`); returns its stream, whose
        one item is the finished `EmbeddingRequestOutput`. Errors and aborting as `add_request`."""
        if not isinstance(pooling, PoolingParams):
            raise UserError(f"pooling: expected a PoolingParams, got {type(pooling).__name__}")
        if not isinstance(request_id, str) or not request_id:
            raise UserError(f"request_id: expected a non-empty string, got {request_id!r}")
        old = self._by_id.get(request_id)
        if old is not None and old.abandoned():
            self._cancel(old)
        stream = _Stream(request_id, asyncio.get_running_loop())
        self._by_id[request_id] = stream
        try:
            await self.call(lambda engine: self._add_pooling(stream, prompt, pooling))
        except BaseException:
            self._cancel(stream)
            raise
        outputs = self._outputs(stream)
        weakref.finalize(outputs, self._cancel, stream).atexit = False
        return outputs

    async def encode(
        self, prompt: str | dict, pooling: PoolingParams | None = None, request_id: str | None = None
    ) -> AsyncIterator[EmbeddingRequestOutput]:
        """vLLM's ``encode``: `add_pooling_request` and iterate; ``pooling`` None: the model's method."""
        request_id = request_id if request_id is not None else uuid.uuid4().hex
        async with aclosing(await self.add_pooling_request(request_id, prompt, pooling or self.engine.default_pooling())) as outputs:
            async for out in outputs:
                yield out

    async def _outputs(self, stream: _Stream) -> AsyncIterator[RequestOutput]:
        """A request's snapshots until the last; leaving early (close, cancel) aborts the request."""
        stream.consumer = asyncio.current_task()
        try:
            while not stream.closed:
                yield await stream.get()
        finally:
            self._cancel(stream)
            self._forget(stream)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its stream ends with finish_reason "abort". Unknown ids are ignored."""
        await self.call(lambda engine: self._abort(self._streams.get(request_id)))

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run ``fn(engine)`` on the worker thread between steps and return its result (or raise).

        Commands run in the order they were submitted, so this also waits for earlier ones.
        """
        loop = asyncio.get_running_loop()
        future = loop.create_future()

        def settle(setter, value) -> None:
            if not future.done():  # the caller may have been cancelled meanwhile
                setter(value)

        def command() -> None:
            try:
                result = fn(self.engine)
            except BaseException as exc:
                setter, value = future.set_exception, exc
            else:
                setter, value = future.set_result, result
            try:
                loop.call_soon_threadsafe(settle, setter, value)
            except RuntimeError:
                pass  # the caller's loop is closed: nobody waits for the answer

        self._submit(command)
        return await future

    def shutdown(self) -> None:
        """Stop the worker after its current step; live streams end with `EngineDeadError`."""
        with self._cond:
            if self._stopped is None:
                self._stopped = EngineDeadError("the engine was shut down")
            self._cond.notify()
        if threading.current_thread() is not self._worker:
            self._worker.join()

    def _submit(self, command: Callable[[], None]) -> None:
        with self._cond:
            if self._stopped is not None:  # a fresh error each time: one raised twice grows its traceback
                raise EngineDeadError(str(self._stopped)) from self._stopped.__cause__
            self._commands.append(command)
            self._cond.notify()

    def _forget(self, stream: _Stream) -> None:
        if self._by_id.get(stream.request_id) is stream:
            self._by_id.pop(stream.request_id, None)

    def _cancel(self, stream: _Stream) -> None:
        """Abort a stream's request unless its consumer is done with it (any thread; never raises)."""
        self._forget(stream)
        if stream.closed:
            return
        stream.closed = True
        try:
            self._submit(lambda: self._abort(stream, notify=False))
        except EngineDeadError:
            pass  # the worker already ended every stream

    # -- the worker's side -------------------------------------------------------------------

    def _run(self) -> None:
        """The worker thread; if it dies of a bug, callers get `EngineDeadError` instead of hanging."""
        try:
            self._loop()
        except BaseException as exc:
            log.exception("the engine worker died")
            dead = EngineDeadError(f"the engine worker died: {exc!r}")
            dead.__cause__ = exc
            with self._cond:
                self._stopped = self._stopped or dead
                commands, self._commands = self._commands, []
            for command in commands:  # settles the futures of callers awaiting `call`
                self._run_command(command)
            for stream in self._streams.values():
                stream.put(dead)
        finally:
            self.engine.shutdown()  # tensor-parallel workers end with the worker thread

    def _loop(self) -> None:
        """Run queued commands, step while work is unfinished, sleep otherwise; until shut down."""
        busy = False
        while True:
            with self._cond:
                while not (self._commands or self._stopped or busy):
                    self._cond.wait()
                commands, self._commands = self._commands, []
                stopped = self._stopped
            for command in commands:
                self._run_command(command)
            if stopped is not None:
                self._end_all(stopped)
                return
            busy = self._step()

    def _run_command(self, command: Callable[[], None]) -> None:
        try:
            command()
        except Exception:
            log.exception("engine command failed")

    def _add(self, stream: _Stream, prompt: str | dict, params: SamplingParams) -> None:
        check_stop_strings(self.tokenizer, params)
        ids, text = prompt_tokens(self.tokenizer, prompt)
        stream.seqs = self.engine.add_request(stream.request_id, ids, params, text)
        stream.holdback = max(map(len, params.stop), default=1) - 1
        self._streams[stream.request_id] = stream

    def _add_pooling(self, stream: _Stream, prompt: str | dict, pooling: PoolingParams) -> None:
        ids, text = prompt_tokens(self.tokenizer, prompt)
        stream.seqs = self.engine.add_pooling_request(stream.request_id, ids, pooling, text)
        stream.sent = 0  # no snapshot before the embedding: it makes no tokens on the way (`_publish`)
        self._streams[stream.request_id] = stream

    def _abort(self, stream: _Stream | None, notify: bool = True) -> None:
        """Abort ``stream``'s request if it is still the live one under its id."""
        if stream is None or self._streams.get(stream.request_id) is not stream:
            return
        del self._streams[stream.request_id]
        self.engine.abort_request(stream.request_id)
        if notify:
            stream.put(stream.snapshot())

    def _step(self) -> bool:
        """One engine step, its outputs sent to their streams; returns whether work remains."""
        if not self.engine.has_unfinished():
            return False
        try:
            updated = self.engine.step()
            for request_id in dict.fromkeys(seq.request_id for seq in updated):
                self._publish(self._streams.get(request_id))
        except Exception as exc:
            log.exception("engine step failed; failing every live request")
            self._end_all(exc)
            return False
        return self.engine.has_unfinished()

    def _publish(self, stream: _Stream | None) -> None:
        """Send a stream its new snapshot; a finished request is released from the engine."""
        if stream is None:
            return
        # Nothing new, unless it finished without a token (the scheduler stopped it: it outgrew the cache).
        if stream.sent == sum(len(s.output_token_ids) for s in stream.seqs) and not all(s.finished for s in stream.seqs):
            return
        out = stream.snapshot()
        if out.finished:
            del self._streams[stream.request_id]
            self.engine.release(stream.request_id)
        if not stream.put(out) and not out.finished:
            self._abort(stream, notify=False)  # its event loop is gone: nobody will read it

    def _end_all(self, error: BaseException) -> None:
        """Abort every live request and raise ``error`` in each of their streams."""
        streams, self._streams = list(self._streams.values()), {}
        for stream in streams:
            stream.put(error)
        try:
            for stream in streams:
                self.engine.abort_request(stream.request_id)
        except Exception as exc:
            log.exception("aborting after a failed step failed too; the engine is unusable")
            with self._cond:
                if self._stopped is None:
                    self._stopped = EngineDeadError(f"the engine failed and could not recover: {exc}")
                    self._stopped.__cause__ = exc
