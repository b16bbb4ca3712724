"""The HTTP application: OpenAI's ``/v1/completions``, ``/v1/chat/completions``, ``/v1/embeddings``, ``/v1/models``
(and ``/v1/models/{id}``), Anthropic's ``/v1/messages`` (and ``/v1/messages/count_tokens``), ``/health``, ``/metrics``, the chat page at ``/``, and the API's
OpenAPI schema at ``/openapi.json`` (browsable at ``/docs``), over `AsyncLLM`.

Every answer that is not a success is JSON in the caller's API shape with the right status
(400 naming the field, 401, 404, 413, 503, 500 without a traceback). Prompts are tokenized (and
chat templates rendered) off the event loop, so a huge prompt does not stall the others. A
client that goes away aborts its requests: streams and plain answers alike watch the connection
(`watch_disconnect`), and leaving the engine's stream aborts the request, so its KV blocks and
slots come back. While the server drains (SIGTERM, see `layerzoo.server.run`) new requests get
503 and the ones in flight finish; a request the drain timeout cuts ends with ``"stop"``.
"""

from __future__ import annotations

import asyncio
import datetime
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import attrs
import tokenizers
from fastapi import FastAPI, Request
from fastapi.openapi.utils import get_openapi
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from pydantic.json_schema import models_json_schema
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from layerzoo.entrypoints.async_llm import AsyncLLM, EngineDeadError
from layerzoo.entrypoints.chat import ChatPlan, prepare_chat
from layerzoo.errors import ConfigError, UserError
from layerzoo.llm import RequestOutput
from layerzoo.plugins.manager import get_registry
from layerzoo.runtime.pooling import PoolingParams
from layerzoo.sampling import SamplingParams
from layerzoo.server import protocol as p
from layerzoo.server.chat_output import AnthropicBlocks, ChoiceStreams, anthropic_content, openai_finish, openai_message
from layerzoo.server.embeddings import EmbeddingRequest, embeddings_response
from layerzoo.server.metrics import Metrics, engine_snapshot
from layerzoo.tokenization.chat_formats import ChatFormat
from layerzoo.tokenization.tokenizer import Tokenizer

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"


@attrs.define
class ServerConfig:
    model_name: str
    api_key: str | None = None
    max_body_bytes: int = 1 << 20  # larger bodies get 413
    drain_timeout_s: float = 30.0  # SIGTERM: in-flight requests get this long, then are aborted
    pooling: str | None = None  # /v1/embeddings: "last" or "mean" (None: the model's own, else last)


@attrs.define
class ServerState:
    """What the routes share: the engine, the settings, in-flight counts and the drain flag."""

    engine: AsyncLLM
    config: ServerConfig
    metrics: Metrics
    max_model_len: int
    inflight: int = 0
    draining: bool = False
    drain_deadline: float | None = None
    live: dict[str, AsyncLLM] = attrs.field(factory=dict)  # engine request ids in flight
    chat_format: ChatFormat | None = None  # how the model writes tool calls and reasoning (its plugin's)
    open_requests: set[anyio.CancelScope] = attrs.field(factory=set)  # every HTTP request in flight

    def begin_drain(self) -> None:
        if not self.draining:
            self.draining = True
            self.drain_deadline = time.monotonic() + self.config.drain_timeout_s
            log.warning("draining: %d request(s) in flight, new ones get 503", self.inflight)

    async def abort_live(self) -> None:
        """Abort every engine request in flight, all between the same two steps (one by one,
        each would wait for a step of the whole batch)."""
        await asyncio.gather(*(self.engine.abort(request_id) for request_id in list(self.live)))

    def cut_open(self) -> None:
        """End every HTTP request still in flight, whatever it waits for (a body that never comes,
        a client that never reads): the drain's last step."""
        for scope in list(self.open_requests):
            scope.cancel()


# -- errors ----------------------------------------------------------------------------------------


def _is_anthropic(request_or_scope) -> bool:
    path = request_or_scope["path"] if isinstance(request_or_scope, dict) else request_or_scope.url.path
    return path.startswith("/v1/messages")


def error_response(error: p.APIError, anthropic: bool = False) -> JSONResponse:
    return JSONResponse(error.anthropic_body() if anthropic else error.openai_body(), status_code=error.status)


_FIELD = re.compile(r"[a-z_][a-z0-9_]*")
_TYPE_TAGS = {"str", "int", "float", "bool", "none", "list", "dict"}


def _is_field(part: Any) -> bool:
    """Whether a part of pydantic's error location names a field or an index, not the member of
    a union pydantic tried (``str``, ``list[int]``, ``TextPart``)."""
    return isinstance(part, int) or (bool(_FIELD.fullmatch(part)) and part not in _TYPE_TAGS)


def _field_parts(loc: tuple, data: Any) -> list[bool]:
    """`_is_field` for each part of ``loc``, where a key or index of the JSON sent is always a
    field (a dict's key ``"50256"`` is not a union member)."""
    flags, value = [], data
    for part in loc:
        if isinstance(value, dict) and part in value:
            value = value[part]
            flags.append(True)
        elif isinstance(value, list) and isinstance(part, int) and 0 <= part < len(value):
            value = value[part]
            flags.append(True)
        else:  # a field the body lacks, or a union member (the value stays the union's)
            flags.append(_is_field(part))
    return flags


def _json_type(value: Any) -> str:
    for python, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"), (list, "list")):
        if isinstance(value, python):
            return name
    return "null" if value is None else "object"


def json_kind(value: Any) -> str:
    """How a JSON value reads in an error: ``true``, ``"yes"``, ``a list of numbers``."""
    if isinstance(value, list):
        return f"a list of {_json_type(value[0])}s" if value else "an empty list"
    if isinstance(value, dict):
        return "an object"
    text = json.dumps(value)  # true, null, 1.5, "yes" (ASCII: a lone surrogate would be escaped)
    return text if len(text) <= 40 else text[:37] + "..."


def validation_error(exc: ValidationError, data: Any) -> p.APIError:
    """A 400 naming the first bad field (``messages.0.role``), what was expected and what came.

    A value that fits no member of a union (``prompt``) is one error at the field, listing the
    members, not pydantic's error inside the first member it tried."""
    errors = exc.errors()
    loc = errors[0]["loc"]
    cut = next((i for i, field in enumerate(_field_parts(loc, data)) if not field), None)
    if cut is None:
        return field_error(errors[0], data)
    base = loc[:cut]
    tried = [e for e in errors if e["loc"][:cut] == base and len(e["loc"]) > cut]
    members = list(dict.fromkeys(e["loc"][cut] for e in tried))
    value = data
    for part in base:
        value = value[part]  # the union's value itself, which pydantic's errors do not hold
    # Only one member of the value's own JSON type (a list for `str | list[TextPart]`): its error says more.
    shaped = [m for m in members if (isinstance(value, list) and m.startswith("list["))
              or (isinstance(value, dict) and m[:1].isupper())]  # a model's name: it takes an object
    if len(shaped) == 1:
        return field_error(next(e for e in tried if e["loc"][cut] == shaped[0]), data)
    field = ".".join(map(str, base))
    return p.APIError(400, f"{field}: expected one of {', '.join(members)}; got {json_kind(value)}", param=field)


def field_error(error: dict, data: Any = None) -> p.APIError:
    """One pydantic error as a 400: ``max_tokens: Input should be a valid integer, got true``."""
    loc = error["loc"]
    field = ".".join(str(part) for part, named in zip(loc, _field_parts(loc, data)) if named) or "body"
    if error["type"] == "extra_forbidden":  # as OpenAI's API refuses it: never silently ignored
        return p.APIError(400, f"{field}: unrecognized request argument supplied (this server refuses fields it "
                               f"does not act on)", param=field)
    got = "" if error["type"] == "missing" else f", got {json_kind(error['input'])}"
    return p.APIError(400, f"{field}: {error['msg']}{got}", param=field)


async def read_body(request: Request, model: type[BaseModel], limit: int) -> Any:
    """The request body parsed into ``model``; 413 past ``limit`` bytes, 400 for bad JSON or fields."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise p.APIError(413, f"request body: {declared} bytes is over the limit of {limit} bytes", code="body_too_large")
    chunks, size = [], 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise p.APIError(413, f"request body: over the limit of {limit} bytes", code="body_too_large")
            chunks.append(chunk)
    except ClientDisconnect:  # gone mid-upload: nobody to answer, and nothing went wrong here
        log.info("%s %s: the client disconnected while sending the body", request.method, request.url.path)
        raise p.APIError(499, "client disconnected") from None
    raw = b"".join(chunks)
    try:
        data = json.loads(raw)
    except RecursionError:
        raise p.APIError(400, "request body: JSON nested too deeply to parse", param="body") from None
    except ValueError as exc:  # not JSON, not UTF-8, or an integer of more than 4300 digits
        raise p.APIError(400, f"request body: not valid JSON ({exc})", param="body") from None
    if not isinstance(data, dict):
        raise p.APIError(400, "request body: expected a JSON object", param="body")
    p.check_json(data)
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise validation_error(exc, data) from None


# -- the connection --------------------------------------------------------------------------------


async def wait_disconnect(receive) -> None:
    """Return when the client has gone (after the request body was read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def watch_disconnect(request: Request, work: Awaitable[Any]) -> Any:
    """Run ``work``; if the client disconnects first, cancel it (its engine requests are aborted)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task not in done:
            task.cancel()
            raise p.APIError(499, "client disconnected")
        return task.result()
    finally:
        watcher.cancel()
        task.cancel()


class EventStream(StreamingResponse):
    """Server-sent events that stop, and close their source, as soon as the client disconnects.

    Starlette only notices a disconnect on the next write under ASGI 2.4; this always listens,
    so an idle stream (a long prefill) is aborted at once, and the source generator is closed
    (its ``finally`` aborts the engine request) rather than left for the garbage collector.
    """

    def __init__(self, content: AsyncIterator[str]):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client went away mid-write
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await wait_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):  # cut by the drain, the source must still be closed
                await self.body_iterator.aclose()


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, separators=(',', ':'))}\n\n"


# -- generation ------------------------------------------------------------------------------------


def check_model(state: ServerState, model: str | None) -> None:
    if model is not None and model != state.config.model_name:
        raise p.APIError(404, f"The model `{model}` does not exist (this server serves `{state.config.model_name}`)",
                         param="model", code="model_not_found")


def check_length(state: ServerState, prompt_len: int, max_tokens: int | None, field: str) -> None:
    if max_tokens is not None and prompt_len + max_tokens > state.max_model_len:
        raise p.APIError(
            400,
            f"{field}: the prompt has {prompt_len} tokens and {field}={max_tokens} asks for more; together they exceed "
            f"the context length of {state.max_model_len} tokens",
            param=field,
        )


def encode(tokenizer, text: str) -> list[int]:
    """``tokenizer.encode(text)``, letting other threads run meanwhile: HF tokenizers' ``encode``
    holds the GIL for the whole call (a 0.9 MB prompt takes 0.5-2 s, and the event loop in the
    other thread stops as long), while their ``encode_batch`` releases it."""
    backend = getattr(tokenizer, "backend", None)
    if type(tokenizer) is Tokenizer and isinstance(backend, tokenizers.Tokenizer):  # encode is backend.encode
        return backend.encode_batch([text], add_special_tokens=True)[0].ids
    return tokenizer.encode(text)


async def tokenized(state: ServerState, text: str, field: str) -> dict:
    """The engine prompt for ``text``: its token ids, counted off the event loop (a 0.9 MB prompt
    keeps the tokenizer busy for a noticeable time, in which /health and live streams go on)."""
    try:
        ids = await asyncio.to_thread(encode, state.engine.tokenizer, text)
    except UserError as exc:
        raise p.APIError(400, f"{field}: {' '.join(str(exc).split())}", param=field) from None
    return {"prompt_token_ids": ids, "prompt": text}


async def chat_prompt(state: ServerState, messages: list[dict], params: SamplingParams,
                      options: dict[str, Any]) -> tuple[ChatPlan, dict]:
    """The chat request prepared (`layerzoo.entrypoints.chat.prepare_chat`: ``options`` are its tools,
    tool_choice, parallel_tool_calls and chat_template_kwargs) and its engine prompt, rendered by
    the chat template and tokenized, both off the event loop (see `tokenized`)."""

    def render() -> tuple[ChatPlan, dict]:
        plan = plan_chat(state, messages, params, options)
        return plan, {"prompt_token_ids": encode(state.engine.tokenizer, plan.prompt), "prompt": plan.prompt}

    return await asyncio.to_thread(render)


async def start(state: ServerState, prompt: dict, params: SamplingParams | PoolingParams, field: str) -> tuple[str, AsyncIterator[RequestOutput]]:
    """Queue one engine request; a bad prompt (empty, too long, bad ids) is a 400 naming ``field``,
    a dead engine a 503."""
    request_id = uuid.uuid4().hex
    try:
        add = state.engine.add_pooling_request if isinstance(params, PoolingParams) else state.engine.add_request
        stream = await add(request_id, prompt, params)
    except UserError as exc:
        raise p.bad_prompt(exc, request_id, field) from None
    except EngineDeadError as exc:
        raise p.APIError(503, f"the engine is not running: {exc}", type="server_error") from None
    state.live[request_id] = state.engine
    return request_id, stream


async def pooled(state: ServerState, request_id: str, stream) -> AsyncIterator:
    """An embedding request's stream (one finished `EmbeddingRequestOutput`); closing it aborts the request."""
    try:
        async with aclosing(stream):
            async for out in stream:
                yield out
    except EngineDeadError as exc:
        raise p.APIError(503, f"the engine stopped: {exc}", type="server_error") from None
    finally:
        state.live.pop(request_id, None)


async def start_all(state: ServerState, prompts: list[tuple[str, dict]], params) -> list[tuple[str, AsyncIterator[RequestOutput]]]:
    """Start every ``(field, prompt)`` of one request, or none: when a later one is refused, the
    earlier ones are aborted before the error goes to the client."""
    started = []
    try:
        for field, prompt in prompts:
            started.append(await start(state, prompt, params, field))
    except BaseException:
        for request_id, _ in started:
            await state.engine.abort(request_id)
            state.live.pop(request_id, None)
        raise
    return started


async def tracked(state: ServerState, request_id: str, stream: AsyncIterator[RequestOutput]) -> AsyncIterator[RequestOutput]:
    """A request's snapshots, with its latency metrics; closing this aborts the request."""
    began, last, sent = time.monotonic(), None, 0
    try:
        async with aclosing(stream):
            async for out in stream:
                now = time.monotonic()
                tokens = sum(len(c.token_ids) for c in out.outputs)
                if tokens > sent:
                    if last is None:
                        state.metrics.ttft.observe(now - began)
                    else:
                        for _ in range(tokens - sent):
                            state.metrics.itl.observe((now - last) / (tokens - sent))
                    last, sent = now, tokens
                if out.finished:
                    state.metrics.e2e.observe(now - began)
                    for c in out.outputs:
                        state.metrics.finished.labels(c.finish_reason or "abort").inc()
                yield out
    except EngineDeadError as exc:
        raise p.APIError(503, f"the engine stopped: {exc}", type="server_error") from None
    except UserError as exc:  # e.g. non-finite logits: the request failed, by the model's fault
        raise p.APIError(500, " ".join(str(exc).split()), type="server_error") from None
    finally:
        state.live.pop(request_id, None)


async def merged(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Snapshots of several requests as they come, tagged with the request's position."""
    if len(streams) == 1:
        async with aclosing(streams[0]) as only:
            async for out in only:
                yield 0, out
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream) -> None:
        try:
            async with aclosing(stream):
                async for out in stream:
                    await queue.put((i, out))
        except BaseException as exc:  # noqa: BLE001 - handed to the reader, which re-raises it
            await queue.put((i, exc))
            return
        await queue.put((i, None))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(streams)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def final_outputs(streams: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    last: dict[int, RequestOutput] = {}
    async for i, out in merged(streams):
        last[i] = out
    return [last[i] for i in range(len(streams))]


# -- response bodies -------------------------------------------------------------------------------


def token_text(state: ServerState, token_id: int) -> str:
    return state.engine.tokenizer.decode([token_id], skip_special_tokens=False)


def _top(entry: dict[int, float], n: int) -> list[tuple[int, float]]:
    return sorted(entry.items(), key=lambda kv: -kv[1])[:n]


def chat_logprobs(state: ServerState, token_ids: list[int], entries: list[dict[int, float]], n: int) -> dict:
    """OpenAI chat ``logprobs``: each token's logprob and the ``n`` most likely alternatives."""

    def item(tid: int, lp: float) -> dict:
        text = token_text(state, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = [
        {**item(tid, entry.get(tid, float("-inf"))), "top_logprobs": [item(t, lp) for t, lp in _top(entry, n)]}
        for tid, entry in zip(token_ids, entries)
    ]
    return {"content": content}


def completion_logprobs(state: ServerState, token_ids: list[int], entries: list[dict[int, float] | None], n: int,
                        offset: int) -> dict:
    """OpenAI (legacy) completions ``logprobs``: tokens, their logprobs, top alternatives, text offsets.
    An entry None (an echoed prompt's first token, which nothing predicts) is null in both lists."""
    tokens = [token_text(state, t) for t in token_ids]
    offsets, at = [], offset
    for text in tokens:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [None if e is None else e.get(t) for t, e in zip(token_ids, entries)],
        "top_logprobs": [None if e is None else {token_text(state, t): lp for t, lp in _top(e, n)} for e in entries],
        "text_offset": offsets,
    }


def best_completions(out: RequestOutput, n: int) -> list:
    """A request's ``n`` completions in answer order: all of them by index, or with ``best_of``
    (more were sampled) the ``n`` of highest cumulative logprob, best first."""
    if len(out.outputs) == n:
        return sorted(out.outputs, key=lambda c: c.index)
    return sorted(out.outputs, key=lambda c: -c.cumulative_logprob)[:n]


def prompt_text(state: ServerState, out: RequestOutput) -> str:
    """The prompt as text: as sent, or token ids decoded (special tokens kept: ``echo`` returns
    the prompt the model saw)."""
    if out.prompt is not None:
        return out.prompt
    return state.engine.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)


def completion_parts(state: ServerState, body: p.CompletionRequest, out: RequestOutput, c) -> tuple[str, list[int], list]:
    """A choice's (text, token ids, logprob entries): the completion, after the prompt with ``echo``
    (its entries from ``prompt_logprobs``, the first None), the prompt alone with ``max_tokens: 0``."""
    generated = ("", [], []) if body.scores_only else (c.text, c.token_ids, c.logprobs or [])
    if not body.echo:
        return generated
    text, ids, entries = generated
    scored = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
    return prompt_text(state, out) + text, list(out.prompt_token_ids) + list(ids), list(scored) + list(entries)


def usage(outs: list[RequestOutput], generated: bool = True) -> dict[str, int]:
    """Token counts; ``generated`` False: the completions were left out of the answer (``echo``
    with ``max_tokens: 0``), and count 0."""
    prompt = sum(len(o.prompt_token_ids) for o in outs)
    completion = sum(len(c.token_ids) for o in outs for c in o.outputs) if generated else 0
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


class ChoiceCursor:
    """How much of each choice a stream has sent: characters, tokens, and whether it finished."""

    def __init__(self):
        self.chars: dict[int, int] = {}
        self.tokens: dict[int, int] = {}
        self.done: set[int] = set()

    def advance(self, key: int, completion) -> tuple[str, list[int], list[dict[int, float]], bool]:
        """(new text, new token ids, their logprob entries, finished now) for one choice's snapshot."""
        chars, tokens = self.chars.get(key, 0), self.tokens.get(key, 0)
        text, ids = completion.text[chars:], completion.token_ids[tokens:]
        entries = (completion.logprobs or [])[tokens:]
        self.chars[key], self.tokens[key] = len(completion.text), len(completion.token_ids)
        finished = completion.finish_reason is not None and key not in self.done
        if finished:
            self.done.add(key)
        return text, ids, entries, finished


# -- the app ---------------------------------------------------------------------------------------

BODIES = (p.CompletionRequest, p.ChatCompletionRequest, p.MessagesRequest, p.CountTokensRequest, EmbeddingRequest)


def request_body(model: type[BaseModel]) -> dict:
    """A route's JSON body in the OpenAPI schema (``openapi_extra``): the routes read their bodies
    themselves (`read_body`: strict types, errors in the API's own shape), so FastAPI cannot see them."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def openapi_schema(app: FastAPI) -> dict:
    """``/openapi.json``: FastAPI's schema of the routes, plus the request bodies' models."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        _, defs = models_json_schema([(m, "validation") for m in BODIES], ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(defs.get("$defs", {}))
        app.openapi_schema = schema
    return app.openapi_schema


def build_app(engine: AsyncLLM, config: ServerConfig) -> FastAPI:
    """The FastAPI application serving ``engine`` (an `AsyncLLM` already started)."""
    from layerzoo import __version__

    app = FastAPI(title="layerzoo", version=__version__, docs_url="/docs", redoc_url=None, openapi_url="/openapi.json",
                  description="OpenAI- and Anthropic-compatible API over a layerzoo engine")
    app.openapi = lambda: openapi_schema(app)
    state = ServerState(engine=engine, config=config, metrics=Metrics(), max_model_len=engine.engine.max_model_len,
                        chat_format=get_registry().chat_format(engine.engine.loaded.architecture))
    app.state.server = state
    created = int(time.time())

    @app.exception_handler(p.APIError)
    async def api_error(request: Request, exc: p.APIError):
        return error_response(exc, _is_anthropic(request))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return error_response(p.APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                                         code="not_found" if exc.status_code == 404 else None), _is_anthropic(request))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("internal error on %s %s", request.method, request.url.path)
        error = p.APIError(500, f"internal error ({type(exc).__name__}); see the server log", type="server_error")
        return error_response(error, _is_anthropic(request))

    # -- pages, health, metrics, models

    @app.get("/", include_in_schema=False)
    async def chat_page():
        return HTMLResponse((STATIC / "index.html").read_text(encoding="utf-8"))

    @app.get("/health")
    async def health():
        if state.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if not engine.is_running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return {"status": "ok"}

    @app.get("/metrics")
    async def metrics():
        state.metrics.snapshot = await engine.call(engine_snapshot)
        body, content_type = state.metrics.render()
        return Response(body, media_type=content_type)

    def model_card(request: Request) -> dict:
        if "anthropic-version" in request.headers:  # Anthropic's client (it always sends the header): its shape
            when = datetime.datetime.fromtimestamp(created, datetime.timezone.utc).isoformat().replace("+00:00", "Z")
            return {"type": "model", "id": config.model_name, "display_name": config.model_name, "created_at": when}
        return {"id": config.model_name, "object": "model", "created": created, "owned_by": "layerzoo",
                "max_model_len": state.max_model_len}

    @app.get("/v1/models")
    async def models(request: Request):
        card = model_card(request)
        if card.get("type") == "model":  # Anthropic's page of models
            return {"data": [card], "has_more": False, "first_id": card["id"], "last_id": card["id"]}
        return {"object": "list", "data": [card]}

    @app.get("/v1/models/{model_id:path}")  # (a path: hub ids hold a slash)
    async def model(model_id: str, request: Request):
        check_model(state, model_id)
        return model_card(request)

    # -- OpenAI completions

    @app.post("/v1/completions", openapi_extra=request_body(p.CompletionRequest))
    async def completions(request: Request):
        body = await read_body(request, p.CompletionRequest, config.max_body_bytes)
        check_model(state, body.model)
        if body.suffix:
            raise p.APIError(400, "suffix: not supported by this server", param="suffix")
        params = body.engine_sampling_params()
        given = body.prompts()
        if len(given) * params.n > 64:
            field = "n" if params.n == body.n else "best_of"
            raise p.APIError(400, f"{field}: {len(given)} prompts x {field}={params.n} completions is over the limit of 64",
                             param=field)
        prompts = []
        for field, prompt in given:
            prompt = await tokenized(state, prompt, field) if isinstance(prompt, str) else {"prompt_token_ids": prompt}
            check_length(state, len(prompt["prompt_token_ids"]), params.max_tokens, "max_tokens")
            prompts.append((field, prompt))
        started = await start_all(state, prompts, params)
        streams = [tracked(state, rid, s) for rid, s in started]
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return EventStream(stream_completions(state, body, params, rid, streams))
        outs = await watch_disconnect(request, final_outputs(streams))
        choices = []
        for i, out in enumerate(outs):
            for k, c in enumerate(best_completions(out, body.n)):
                text, ids, entries = completion_parts(state, body, out, c)
                logprobs = None
                if body.logprobs is not None:
                    logprobs = completion_logprobs(state, ids, entries, body.logprobs, 0)
                choices.append({"index": i * body.n + k, "text": text, "logprobs": logprobs,
                                "finish_reason": p.finish_reason(c.finish_reason)})
        return {"id": rid, "object": "text_completion", "created": int(time.time()), "model": config.model_name,
                "choices": choices, "usage": usage(outs, generated=not body.scores_only)}

    # -- OpenAI chat completions

    @app.post("/v1/chat/completions", openapi_extra=request_body(p.ChatCompletionRequest))
    async def chat_completions(request: Request):
        body = await read_body(request, p.ChatCompletionRequest, config.max_body_bytes)
        check_model(state, body.model)
        field = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        params = body.sampling_params(max_tokens, body.logprobs_count())
        plan, prompt = await chat_prompt(state, body.template_messages(), params, body.tool_options())
        params = plan.params
        check_length(state, len(prompt["prompt_token_ids"]), max_tokens, field)
        request_id, stream = await start(state, prompt, params, "messages")
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return EventStream(stream_chat(state, body, params, rid, tracked(state, request_id, stream), plan))
        (out,) = await watch_disconnect(request, final_outputs([tracked(state, request_id, stream)]))
        choices = []
        for c in out.outputs:
            parsed = plan.parse(c.text)
            choices.append({
                "index": c.index,
                "message": openai_message(parsed),
                "logprobs": chat_logprobs(state, c.token_ids, c.logprobs or [], params.logprobs) if params.logprobs is not None else None,
                "finish_reason": openai_finish(p.finish_reason(c.finish_reason), bool(parsed.tool_calls)),
            })
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": config.model_name,
                "choices": choices, "usage": usage([out])}

    # -- OpenAI embeddings

    @app.post("/v1/embeddings", openapi_extra=request_body(EmbeddingRequest))
    async def embeddings(request: Request):
        body = await read_body(request, EmbeddingRequest, config.max_body_bytes)
        check_model(state, body.model)
        pooling = PoolingParams(config.pooling) if config.pooling else engine.engine.default_pooling()
        prompts = [(field, await tokenized(state, item, field) if isinstance(item, str) else {"prompt_token_ids": item})
                   for field, item in body.prompts()]
        started = await start_all(state, prompts, pooling)
        outs = await watch_disconnect(request, final_outputs([pooled(state, rid, s) for rid, s in started]))
        if any(out.outputs is None for out in outs):  # aborted: the drain's timeout cut it
            raise p.APIError(503, "the server shut down before the embeddings were computed", type="server_error",
                             code="shutting_down")
        return embeddings_response(outs, body.encoding_format, config.model_name)

    # -- Anthropic messages

    @app.post("/v1/messages", openapi_extra=request_body(p.MessagesRequest))
    async def messages(request: Request):
        body = await read_body(request, p.MessagesRequest, config.max_body_bytes)
        check_model(state, body.model)
        params = body.sampling_params(body.max_tokens)
        plan, prompt = await chat_prompt(state, body.template_messages(), params, body.tool_options())
        params = plan.params
        check_length(state, len(prompt["prompt_token_ids"]), body.max_tokens, "max_tokens")
        try:
            request_id, stream = await start(state, prompt, params, "messages")
        except p.APIError as exc:
            if exc.param == "thinking_token_budget":  # the engine's name for thinking.budget_tokens
                raise p.APIError(400, exc.message.replace("SamplingParams.thinking_token_budget", "thinking.budget_tokens"),
                                 param="thinking.budget_tokens") from None
            raise
        mid = f"msg_{uuid.uuid4().hex}"
        if body.stream:
            return EventStream(stream_messages(state, mid, tracked(state, request_id, stream), plan))
        (out,) = await watch_disconnect(request, final_outputs([tracked(state, request_id, stream)]))
        c = out.outputs[0]
        events = plan.events(c.text)
        reason, sequence = anthropic_stop(c, any(e.kind == "tool_call" for e in events))
        return {"id": mid, "type": "message", "role": "assistant", "model": config.model_name,
                "content": anthropic_content(events), "stop_reason": reason, "stop_sequence": sequence,
                "usage": {"input_tokens": len(out.prompt_token_ids), "output_tokens": len(c.token_ids)}}

    @app.post("/v1/messages/count_tokens", openapi_extra=request_body(p.CountTokensRequest))
    async def count_tokens(request: Request):
        body = await read_body(request, p.CountTokensRequest, config.max_body_bytes)
        check_model(state, body.model)
        body.check_counted()
        body.max_tokens = state.max_model_len  # the most a thinking budget could be
        _, prompt = await chat_prompt(state, body.template_messages(), SamplingParams(max_tokens=1), body.tool_options())
        return {"input_tokens": len(prompt["prompt_token_ids"])}

    app.add_middleware(GateMiddleware, state=state)
    return app


def plan_chat(state: ServerState, messages: list[dict], params: SamplingParams, options: dict[str, Any]) -> ChatPlan:
    """`prepare_chat` for the served model; a template's failure is a 400 naming ``messages``,
    a bad tool field a 400 naming it (``tool_choice``, ``tools.0``, ``messages.2.tool_calls.0...``)."""
    try:
        return prepare_chat(state.engine.tokenizer, state.chat_format, messages, params, **options)
    except ConfigError as exc:
        raise p.APIError(400, f"messages: {' '.join(str(exc).split())}", param="messages") from None
    except UserError as exc:
        message = " ".join(str(exc).split())
        head = message.split(":", 1)[0]
        raise p.APIError(400, message, param=head if " " not in head else None) from None


def anthropic_stop(c, called: bool = False) -> tuple[str, str | None]:
    if c.finish_reason == "length":
        return "max_tokens", None
    if called and c.finish_reason == "stop" and not isinstance(c.stop_reason, str):
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


# -- streams ---------------------------------------------------------------------------------------


async def stream_errors(events: AsyncIterator[str], anthropic: bool = False) -> AsyncIterator[str]:
    """An error after the stream began is one last event in the API's shape (then ``[DONE]``)."""
    try:
        async with aclosing(events):
            async for event in events:
                yield event
    except p.APIError as exc:
        if anthropic:
            yield f"event: error\ndata: {json.dumps(exc.anthropic_body())}\n\n"
        else:
            yield sse(exc.openai_body())
            yield "data: [DONE]\n\n"


def stream_completions(state, body, params, rid, streams) -> AsyncIterator[str]:
    async def events():
        cursor, last = ChoiceCursor(), {}
        echoed: dict[int, str] = {}  # choice -> the prompt text its first chunk carried (echo)
        created = int(time.time())
        async for i, out in merged(streams):
            last[i] = out
            for c in out.outputs:
                key = i * params.n + c.index
                text, ids, entries, finished = cursor.advance(key, c)
                offset = cursor.chars[key] - len(text)
                if body.scores_only:
                    text, ids, entries = "", [], []
                if body.echo and (c.token_ids or finished):  # the prompt has run: its logprobs are all in
                    if key not in echoed:  # the first chunk of the choice carries the prompt
                        echoed[key] = prompt_text(state, out)
                        prompt_ids, scored = out.prompt_token_ids, out.prompt_logprobs or [None] * len(out.prompt_token_ids)
                        text, ids, entries = echoed[key] + text, list(prompt_ids) + ids, list(scored) + list(entries)
                        offset = 0
                    else:
                        offset += len(echoed[key])
                if not (text or finished):
                    continue
                logprobs = None
                if params.logprobs is not None:
                    logprobs = completion_logprobs(state, ids, entries, params.logprobs, offset)
                chunk = {"id": rid, "object": "text_completion", "created": created, "model": state.config.model_name,
                         "choices": [{"index": key, "text": text, "logprobs": logprobs,
                                      "finish_reason": p.finish_reason(c.finish_reason) if finished else None}]}
                if body.include_usage:
                    chunk["usage"] = None
                yield sse(chunk)
        if body.include_usage:
            yield sse({"id": rid, "object": "text_completion", "created": created, "model": state.config.model_name,
                       "choices": [], "usage": usage([last[i] for i in sorted(last)], generated=not body.scores_only)})
        yield "data: [DONE]\n\n"

    return stream_errors(events())


def stream_chat(state, body, params, rid, stream, plan: ChatPlan) -> AsyncIterator[str]:
    """Chat chunks: each choice's text through its stream parser (content, reasoning_content and
    tool_calls deltas; text that may still be a marker is held back)."""

    async def events():
        cursor, last, parsers = ChoiceCursor(), None, ChoiceStreams(plan)
        created = int(time.time())
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": state.config.model_name}
        extra = {"usage": None} if body.include_usage else {}
        for k in range(params.n):
            yield sse({**base, "choices": [{"index": k, "delta": {"role": "assistant", "content": ""},
                                            "logprobs": None, "finish_reason": None}], **extra})
        async for _, out in merged([stream]):
            last = out
            for c in out.outputs:
                text, ids, entries, finished = cursor.advance(c.index, c)
                if not (text or finished):
                    continue
                deltas = parsers.deltas(c.index, c.text, c.finish_reason is not None)
                logprobs = chat_logprobs(state, ids, entries, params.logprobs) if params.logprobs is not None else None
                if not deltas and (finished or logprobs is not None):
                    deltas = [{}]
                reason = openai_finish(p.finish_reason(c.finish_reason), c.index in parsers.called) if finished else None
                for j, delta in enumerate(deltas):
                    yield sse({**base, "choices": [{"index": c.index, "delta": delta,
                                                    "logprobs": logprobs if j == 0 else None,
                                                    "finish_reason": reason if j == len(deltas) - 1 else None}],
                                **extra})
        if body.include_usage and last is not None:
            yield sse({**base, "choices": [], "usage": usage([last])})
        yield "data: [DONE]\n\n"

    return stream_errors(events())


def stream_messages(state, mid, stream, plan: ChatPlan) -> AsyncIterator[str]:
    """Anthropic's event sequence: message_start, then per content block (thinking, text,
    tool_use) content_block_start, its deltas (thinking_delta, text_delta, input_json_delta) and
    content_block_stop, then message_delta (stop reason, usage), message_stop."""

    def event(name: str, data: dict) -> str:
        return f"event: {name}\ndata: {json.dumps({'type': name, **data}, separators=(',', ':'))}\n\n"

    pinged = False

    def block_events(items: list[tuple[str, dict]]):
        nonlocal pinged
        for name, data in items:
            yield event(name, data)
            if name == "content_block_start" and not pinged:  # Anthropic pings after the first block opens
                pinged = True
                yield event("ping", {})

    async def events():
        out, parsers, blocks = None, ChoiceStreams(plan), AnthropicBlocks()
        started = False
        async for _, out in merged([stream]):
            if not started:
                started = True
                yield event("message_start", {"message": {
                    "id": mid, "type": "message", "role": "assistant", "model": state.config.model_name, "content": [],
                    "stop_reason": None, "stop_sequence": None,
                    "usage": {"input_tokens": len(out.prompt_token_ids), "output_tokens": 0}}})
            c = out.outputs[0]
            for item in block_events(blocks.events(parsers.events(0, c.text, c.finish_reason is not None))):
                yield item
        c = out.outputs[0]
        reason, sequence = anthropic_stop(c, blocks.tool_calls > 0)
        for item in block_events(blocks.finish()):
            yield item
        yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                      "usage": {"output_tokens": len(c.token_ids)}})
        yield event("message_stop", {})

    return stream_errors(events(), anthropic=True)


# -- the gate: API key, drain, in-flight count ------------------------------------------------------


class GateMiddleware:
    """Before any route: 503 while draining, 401 without the API key; counts the requests in
    flight, and can end them (`ServerState.cut_open`)."""

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        anthropic = _is_anthropic(scope)
        if path.startswith("/v1/"):
            if self.state.draining:
                error = p.APIError(503, "the server is shutting down; retry on another replica", type="server_error",
                                   code="shutting_down")
                return await error_response(error, anthropic)(scope, receive, send)
            key = self.state.config.api_key
            if key is not None and not self._authorized(scope, key):
                error = p.APIError(401, "missing or wrong API key (send 'Authorization: Bearer KEY' or 'x-api-key: KEY')",
                                   type="authentication_error", code="invalid_api_key")
                return await error_response(error, anthropic)(scope, receive, send)
        self.state.inflight += 1
        started = False

        async def watched_send(message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        cut = anyio.CancelScope()
        self.state.open_requests.add(cut)
        try:
            with cut:
                await self.app(scope, receive, watched_send)
            if cut.cancelled_caught and not started:  # e.g. a body still on its way: say why it ends
                error = p.APIError(503, "the server shut down before this request ended", type="server_error",
                                   code="shutting_down")
                await error_response(error, anthropic)(scope, receive, send)
        finally:
            self.state.open_requests.discard(cut)
            self.state.inflight -= 1

    @staticmethod
    def _authorized(scope, key: str) -> bool:
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        return headers.get("authorization") == f"Bearer {key}" or headers.get("x-api-key") == key

