"""Request bodies of the OpenAI and Anthropic endpoints, and the `SamplingParams` they become.

Each body is a pydantic model: a wrong type or a missing field is refused before anything runs,
with a 400 naming the field (``app`` turns pydantic's error into the OpenAI error shape). The
models are strict: JSON's types are taken as they are, never coerced (``max_tokens: true`` is not
1, ``"10"`` is not 10, ``stream: "yes"`` is not true, ``[1.0, 2.0]`` are not token ids), because a
client sending those has a bug that a coerced answer would hide. An unknown field is refused by
name, as OpenAI's own API refuses unrecognized arguments: a field the server would not act on
must not look honoured. The fields that carry no generation meaning (OpenAI's ``user``,
``metadata``, ``store``, ``service_tier``, ``safety_identifier``, ``prompt_cache_key``;
Anthropic's ``metadata``, ``service_tier`` and blocks' ``cache_control``) are declared, accepted
and change nothing.
Values that pass the types but not the engine's rules (``temperature=-1``, ``n=99``) are refused
by `SamplingParams`, whose error names the field too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from layerzoo.errors import UserError
from layerzoo.llm import check_text, renamed
from layerzoo.runtime.structured_outputs import unknown_fields
from layerzoo.sampling import MAX_N, SamplingParams, StructuredOutputsParams

# JSON nested deeper than this is refused before validation: no body the endpoints take comes
# near it, and deeper ones only exhaust the parser's and the validators' recursion.
MAX_JSON_DEPTH = 64


class APIError(Exception):
    """An error answered to the client as JSON with ``status`` (never a traceback)."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def openai_body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kinds = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                 413: "request_too_large", 503: "overloaded_error"}
        return {"type": "error", "error": {"type": kinds.get(self.status, "api_error"), "message": self.message}}


def check_json(data: Any) -> None:
    """Refuse, naming where, what JSON allows but no prompt can hold: nesting deeper than
    `MAX_JSON_DEPTH`, and text with a lone surrogate (``"a\\ud800b"`` is valid JSON, but no
    UTF-8 text, so a tokenizer cannot take it)."""
    stack: list[tuple[Any, str, int]] = [(data, "", 0)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            where = path if len(path) <= 60 else path[:57] + "..."
            raise APIError(400, f"request body: nested deeper than {MAX_JSON_DEPTH} levels (at {where})", param="body")
        if isinstance(value, str):
            try:
                check_text(value, path or "body")
            except UserError as exc:
                raise APIError(400, str(exc), param=path or "body") from None
        elif isinstance(value, dict):
            for key, item in value.items():
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
                stack.append((key, f"{path or 'body'} (a key)", depth + 1))  # text too: checked first, paths hold it
        elif isinstance(value, list):  # (token ids are most of a long list: only containers and text are walked)
            stack.extend((item, f"{path}.{i}" if path else str(i), depth + 1)
                         for i, item in enumerate(value) if isinstance(item, (str, dict, list)))


def finish_reason(reason: str | None) -> str | None:
    """The engine's finish reason as an OpenAI value: a request the server aborted (the drain
    timeout) ends with ``"stop"``, as OpenAI's enum has no value for it (vLLM sends its own "abort")."""
    return "stop" if reason == "abort" else reason


def bad_prompt(exc: UserError, request_id: str, field: str) -> APIError:
    """A 400 for the engine refusing a prompt; the engine names the request by its internal id,
    the client knows it as ``field`` (``prompt``, ``prompt.1``, ``messages``)."""
    named = renamed(exc, request_id, field)
    if named is exc:
        return bad_field(exc)
    return APIError(400, " ".join(str(named).split()), param=field)


def bad_field(exc: UserError) -> APIError:
    """A 400 for an engine-side `UserError`; ``param`` is the field its message starts with."""
    message = " ".join(str(exc).split())
    head = message.split(":", 1)[0]
    param = head.removeprefix("SamplingParams.") if head.replace("SamplingParams.", "").isidentifier() else None
    return APIError(400, message, param=param)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class JsonSchemaFormat(_Body):
    """OpenAI's ``response_format.json_schema``: the schema is enforced whatever ``strict`` says
    (the constraint decides every token; vLLM does the same)."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


def _constraint(field: str, **kwargs) -> StructuredOutputsParams:
    """`StructuredOutputsParams` from a request's ``field``; its error is a 400 naming the field
    (``structured_outputs.regex``, ``response_format.json_schema.schema``)."""
    if (unknown := unknown_fields(kwargs)) is not None:
        raise APIError(400, f"{field}: {unknown}", param=field)
    try:
        return StructuredOutputsParams(**kwargs)
    except UserError as exc:
        message = " ".join(str(exc).split())
        head, _, rest = message.partition(": ")
        key = head.removeprefix("StructuredOutputsParams").lstrip(".")
        name = field if field != "structured_outputs" or not key else f"{field}.{key}"
        raise APIError(400, f"{name}: {rest}", param=name) from None


class StreamOptions(_Body):
    include_usage: bool = False


class _Sampling(_Body):
    """Fields the OpenAI completion and chat bodies share (and vLLM's extensions: top_k, min_p, ...)."""

    model: str | None = None
    # OpenAI's fields without generation meaning: accepted, and change nothing here
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None  # (prefix caching is automatic)
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Constrained output: OpenAI's response_format, or vLLM's structured_outputs (json, regex,
    # choice, grammar, json_object and its options); one of them.
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = None
    # OpenAI's {"token id": bias in [-100, 100]}, added to the logits before sampling
    logit_bias: dict[str, float] | None = None
    # vLLM's: after this many generated tokens of reasoning the model's </think> is forced
    thinking_token_budget: int | None = None

    def logit_bias_ids(self) -> dict[int, float] | None:
        """``logit_bias`` keyed by int token ids; a key that is not one is a 400 naming it."""
        if self.logit_bias is None:
            return None
        for key in self.logit_bias:
            if not (key.isascii() and key.isdigit() and len(key) <= 12):
                raise APIError(400, f"logit_bias: keys are token ids as strings (\"50256\"), got {key!r:.40}", param="logit_bias")
        return {int(key): bias for key, bias in self.logit_bias.items()}

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        fmt = self.response_format
        if fmt is not None and fmt.type != "text" and self.structured_outputs is not None:
            raise APIError(400, "response_format: give one of response_format and structured_outputs", param="response_format")
        if self.structured_outputs is not None:
            return _constraint("structured_outputs", **self.structured_outputs)
        if fmt is None or fmt.type == "text":
            return None
        if fmt.type == "json_object":
            return _constraint("response_format", json_object=True)
        where = "response_format.json_schema.schema"
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, f"{where}: expected a JSON schema (an object) with type json_schema", param=where)
        return _constraint(where, json=fmt.json_schema.schema_)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None, prompt_logprobs: int | None = None) -> SamplingParams:
        """The engine's parameters; a value out of range is a 400 naming its field."""
        given = {
            "prompt_logprobs": prompt_logprobs,
            "n": self.n, "temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k,
            "min_p": self.min_p, "repetition_penalty": self.repetition_penalty,
            "presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
            "seed": self.seed, "stop": self.stop, "stop_token_ids": self.stop_token_ids,
            "ignore_eos": self.ignore_eos, "min_tokens": self.min_tokens, "logprobs": logprobs,
            "structured_outputs": self.structured_outputs_params(), "logit_bias": self.logit_bias_ids(),
            "thinking_token_budget": self.thinking_token_budget,
        }
        try:
            return SamplingParams(max_tokens=max_tokens, **{k: v for k, v in given.items() if v is not None})
        except UserError as exc:
            raise bad_field(exc) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a prompt (text, token ids, or a list of either) continued."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    # The prompt before the completion, and with logprobs its tokens scored too (the first one
    # null); max_tokens 0 scores the prompt alone (lm-eval-harness's loglikelihood requests)
    echo: bool = False
    suffix: str | None = None
    # best_of > n: best_of completions sampled, the n of highest cumulative logprob returned
    best_of: int | None = None

    @property
    def scores_only(self) -> bool:
        """``echo`` with ``max_tokens: 0``: the prompt, scored, and nothing generated."""
        return self.echo and self.max_tokens == 0

    def engine_sampling_params(self) -> SamplingParams:
        """The engine's parameters: with ``echo`` and ``logprobs`` the prompt is scored as well
        (``prompt_logprobs``); ``max_tokens: 0`` (only with ``echo``) runs one token, which the
        answer leaves out, as vLLM does."""
        if self.max_tokens == 0 and not self.echo:
            raise APIError(400, "max_tokens: 0 is only allowed with echo=true (it scores the prompt)", param="max_tokens")
        max_tokens = 1 if self.scores_only else self.max_tokens
        params = self.sampling_params(max_tokens, self.logprobs, self.logprobs if self.echo else None)
        if self.best_of is not None and self.best_of != self.n:
            self._sample_best_of(params)
        return params

    def _sample_best_of(self, params: SamplingParams) -> None:
        """``params`` sampling ``best_of`` completions, with the logprobs their ranking needs
        (vLLM v0's best_of: the answer keeps the ``n`` of highest cumulative logprob)."""
        if not (isinstance(self.best_of, int) and self.n < self.best_of <= MAX_N):
            raise APIError(400, f"best_of: expected an int from n ({self.n}) to {MAX_N}, got {self.best_of}", param="best_of")
        if self.stream:
            raise APIError(400, "best_of: cannot be streamed when best_of > n (the best are known only at the end)",
                           param="best_of")
        params.n = self.best_of
        if params.logprobs is None:
            params.logprobs = 0

    def prompts(self) -> list[tuple[str, str | list[int]]]:
        """One ``(field, text or token ids)`` per engine prompt; ``field`` names it in errors
        (``prompt``, or ``prompt.1`` for the second of a list)."""
        p = self.prompt
        if isinstance(p, str):
            return [("prompt", p)]
        if not p:
            raise APIError(400, "prompt: expected a non-empty string, list of strings or list of token ids", param="prompt")
        if all(isinstance(x, int) for x in p):
            return [("prompt", list(p))]
        return [(f"prompt.{i}", x if isinstance(x, str) else list(x)) for i, x in enumerate(p)]


class TextPart(_Body):
    type: Literal["text"]
    text: str
    cache_control: dict[str, Any] | None = None  # Anthropic's caching hint: no meaning (prefix caching is automatic)


class FunctionCall(_Body):
    name: str
    arguments: str  # JSON text of an object, as OpenAI sends it


class ToolCallMessage(_Body):
    """A call in an earlier assistant message (``messages[i].tool_calls``)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None  # the schema is enforced for required / named tool_choice either way


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: str


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant's reasoning, for templates that show it

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``: messages rendered with the checkpoint's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Tool calling (parsed in the model's chat format, layerzoo.entrypoints.chat) and template variables.
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, Any] | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        # "developer" is OpenAI's newer name for "system"; chat templates know "system".
        messages = []
        for i, m in enumerate(self.messages):
            if m.role == "tool" and m.tool_call_id is None:
                raise APIError(400, f"messages.{i}.tool_call_id: required for a message of role tool", param=f"messages.{i}.tool_call_id")
            if m.tool_calls is not None and m.role != "assistant":
                raise APIError(400, f"messages.{i}.tool_calls: only an assistant message has tool calls", param=f"messages.{i}.tool_calls")
            message = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
            extra = {"name": m.name, "tool_call_id": m.tool_call_id, "reasoning_content": m.reasoning_content,
                     "tool_calls": [c.model_dump() for c in m.tool_calls] if m.tool_calls is not None else None}
            messages.append({**message, **{k: v for k, v in extra.items() if v is not None}})
        return messages

    def tool_options(self) -> dict[str, Any]:
        """`layerzoo.entrypoints.chat.prepare_chat`'s tool arguments from this request."""
        choice = self.tool_choice.model_dump() if isinstance(self.tool_choice, NamedToolChoice) else self.tool_choice
        return {"tools": [t.model_dump(exclude_none=True) for t in self.tools] if self.tools is not None else None,
                "tool_choice": choice, "parallel_tool_calls": self.parallel_tool_calls,
                "chat_template_kwargs": self.chat_template_kwargs}

    def logprobs_count(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs: only allowed with logprobs=true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class ToolUseBlock(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: dict[str, Any] | None = None  # (no meaning here)


class ToolResultBlock(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[TextPart] = ""
    is_error: bool = False
    cache_control: dict[str, Any] | None = None  # (no meaning here)

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return f"Error: {text}" if self.is_error else text


class ThinkingBlock(_Body):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


ContentBlock = Annotated[TextPart | ToolUseBlock | ToolResultBlock | ThinkingBlock, Field(discriminator="type")]


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content if isinstance(p, TextPart))

    def template_messages(self, where: str) -> list[dict[str, Any]]:
        """As chat-template messages: a user's ``tool_result`` blocks become ``tool`` messages
        (before the text); an assistant's ``tool_use`` blocks its ``tool_calls``, its ``thinking``
        its ``reasoning_content``."""
        blocks = [TextPart(type="text", text=self.content)] if isinstance(self.content, str) else self.content
        kinds = {type(b) for b in blocks}
        if self.role == "user" and kinds & {ToolUseBlock, ThinkingBlock}:
            raise APIError(400, f"{where}.content: a user message holds text and tool_result blocks", param=f"{where}.content")
        if self.role == "assistant" and ToolResultBlock in kinds:
            raise APIError(400, f"{where}.content: tool_result blocks belong in a user message", param=f"{where}.content")
        if self.role == "user":
            results = [{"role": "tool", "tool_call_id": b.tool_use_id, "content": b.text()} for b in blocks
                       if isinstance(b, ToolResultBlock)]
            text = self.text()
            return results + ([{"role": "user", "content": text}] if text or not results else [])
        message: dict[str, Any] = {"role": "assistant", "content": self.text()}
        thinking = "".join(b.thinking for b in blocks if isinstance(b, ThinkingBlock))
        if thinking:
            message["reasoning_content"] = thinking
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": b.input}}
                 for b in blocks if isinstance(b, ToolUseBlock)]
        if calls:
            message["tool_calls"] = calls
        return [message]


class AnthropicTool(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: dict[str, Any] | None = None  # (no meaning here)


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class Thinking(_Body):
    # "adaptive" (the model decides how much to think): thinking on, with no budget
    type: Literal["enabled", "adaptive", "disabled"]
    # The most tokens the reasoning may take: then the model's </think> is forced and the answer
    # follows (SamplingParams.thinking_token_budget); below max_tokens, as Anthropic requires.
    budget_tokens: int | None = None


class MessagesRequest(_Body):
    """``POST /v1/messages``: Anthropic's Messages API (text content blocks)."""

    model: str | None = None
    max_tokens: int
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: str | list[TextPart] | None = None
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: Thinking | None = None
    # Anthropic's fields without generation meaning: accepted, and change nothing here
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None

    def template_messages(self) -> list[dict[str, Any]]:
        messages = []
        if self.system:
            system = self.system if isinstance(self.system, str) else "".join(p.text for p in self.system)
            messages.append({"role": "system", "content": system})
        for i, m in enumerate(self.messages):
            messages += m.template_messages(f"messages.{i}")
        return messages

    def tool_options(self) -> dict[str, Any]:
        """`layerzoo.entrypoints.chat.prepare_chat`'s tool arguments: Anthropic's tools as OpenAI's, its
        ``tool_choice`` (auto / any / tool / none) as auto / required / named / none, and
        ``thinking`` as the template's ``enable_thinking``."""
        tools = None if self.tools is None else [
            # OpenAI's key order (name, description, parameters): templates write the tool with tojson
            {"type": "function", "function": {"name": t.name, **({"description": t.description} if t.description else {}),
                                              "parameters": t.input_schema}}
            for t in self.tools]
        choice, parallel = None, True
        if self.tool_choice is not None:
            c = self.tool_choice
            if (c.type == "tool") != (c.name is not None):
                raise APIError(400, "tool_choice.name: given with type tool, and only then", param="tool_choice.name")
            choice = {"auto": "auto", "any": "required", "none": "none"}.get(c.type) or {"type": "function", "function": {"name": c.name}}
            parallel = not c.disable_parallel_tool_use
        kwargs = None
        if self.thinking is not None:
            self.thinking_budget()
            kwargs = {"enable_thinking": self.thinking.type != "disabled"}
        return {"tools": tools, "tool_choice": choice, "parallel_tool_calls": parallel, "chat_template_kwargs": kwargs}

    def thinking_budget(self) -> int | None:
        """``thinking.budget_tokens`` checked: given with type enabled (and only then), in [1, max_tokens)."""
        if self.thinking is None:
            return None
        budget = self.thinking.budget_tokens
        if self.thinking.type != "enabled" and budget is not None:
            raise APIError(400, f"thinking.budget_tokens: only with type 'enabled', not {self.thinking.type!r}",
                           param="thinking.budget_tokens")
        if self.thinking.type == "enabled" and (budget is None or not 1 <= budget < self.max_tokens):
            raise APIError(400, f"thinking.budget_tokens: expected an integer >= 1 and below max_tokens ({self.max_tokens}), got {budget}",
                           param="thinking.budget_tokens")
        return budget

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        given = {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k, "stop": self.stop_sequences,
                 "thinking_token_budget": self.thinking_budget()}
        try:
            return SamplingParams(max_tokens=max_tokens, **{k: v for k, v in given.items() if v is not None})
        except UserError as exc:
            raise bad_field(exc) from None


class CountTokensRequest(MessagesRequest):
    """``POST /v1/messages/count_tokens``: Anthropic's token count of what ``/v1/messages`` would
    render from ``system``, ``messages``, ``tools``, ``tool_choice`` and ``thinking``. Its fields
    are the Messages body's without the generation ones, which are refused by name."""

    max_tokens: int | None = None

    def check_counted(self) -> None:
        """Refuse the Messages fields that only steer generation: count_tokens does not take them."""
        for name in ("max_tokens", "stop_sequences", "temperature", "top_p", "top_k", "stream"):
            if name in self.model_fields_set:
                raise APIError(400, f"{name}: unrecognized request argument supplied (count_tokens takes model, "
                                    f"messages, system, tools, tool_choice and thinking)", param=name)
