"""One chat request prepared for the engine: the rendered prompt, the sampling parameters its tools
ask for, and how its output is read back (`ChatPlan`). Shared by ``LLM.chat`` and the server.

``tools`` are OpenAI's ``[{"type": "function", "function": {"name", "description",
"parameters"}}]``; the chat template receives them as ``tools=``. ``tool_choice``:

- ``"auto"`` (the default with tools): the output is parsed for calls in the model's chat format;
- ``"none"``: the template still sees the tools, nothing is parsed as a call;
- ``"required"`` or ``{"type": "function", "function": {"name": ...}}``: generation is constrained
  by the format's tool-call grammar (`layerzoo.tokenization.chat_formats.ChatFormat.tool_call_grammar`,
  through structured outputs), so the output always parses as calls whose arguments match the
  tool's ``parameters`` schema. ``parallel_tool_calls=False`` allows one call only.

Errors are `UserError` starting with the request field they are about (``tool_choice: ...``).
"""

from __future__ import annotations

import json
from typing import Any

import attrs

from layerzoo.errors import UserError
from layerzoo.runtime.structured_outputs import StructuredOutputsParams
from layerzoo.sampling import SamplingParams
from layerzoo.tokenization.chat_formats import ChatFormat, ParsedMessage, StreamEvent, StreamParser, collect, tool_function

TOOL_CHOICES = ("auto", "none", "required")
# Variables the renderer sets itself: chat_template_kwargs may not replace them.
RESERVED_TEMPLATE_KWARGS = ("messages", "tools", "add_generation_prompt")


@attrs.frozen
class ChatPlan:
    """A prepared chat request: ``prompt`` (the rendered text), ``params`` (with the tool-call
    constraint and special-token setting applied), and how to read the output."""

    prompt: str
    params: SamplingParams
    chat_format: ChatFormat | None
    parse_tools: bool
    reasoning_open: bool
    # Texts of the end-of-sequence tokens, which a request keeping special tokens gets at the end
    # of its text (the engine decodes the EOS token it stopped on): not part of the message.
    eos_texts: tuple[str, ...] = ()
    # The tools' parameters schemas by name: a format whose text does not type its values
    # (Qwen3-Coder's XML) reads them by these
    schemas: dict[str, dict] = attrs.field(factory=dict)

    def visible(self, text: str, finished: bool) -> str:
        """``text`` without the EOS token's text a finished output ends with."""
        if finished:
            for eos in self.eos_texts:
                if text.endswith(eos):
                    return text[: -len(eos)]
        return text

    def parse(self, text: str) -> ParsedMessage:
        """A finished output's text split into content, reasoning and tool calls."""
        if self.chat_format is None:
            return ParsedMessage(content=self.visible(text, True), reasoning_content=None)
        return collect(self.events(text))

    def events(self, text: str) -> list[StreamEvent]:
        """A finished output's stream events, in the order of the text (Anthropic's content blocks
        keep that order: a call's ``tool_use`` before the text written after it)."""
        text = self.visible(text, True)
        parser = self.stream()
        if parser is None:
            return [StreamEvent("content", text)] if text else []
        return parser.feed(text) + parser.finish()

    def stream(self) -> StreamParser | None:
        """An incremental parser of the output, or None (no chat format: the text is content)."""
        if self.chat_format is None:
            return None
        return self.chat_format.stream(reasoning_open=self.reasoning_open, tools=self.parse_tools, schemas=self.schemas)


def named_choice(tool_choice: Any) -> str | None:
    """The function name of a named ``tool_choice`` (``{"type": "function", "function": {"name": ...}}``)."""
    if isinstance(tool_choice, dict):
        fn = tool_choice.get("function")
        if tool_choice.get("type") == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return fn["name"]
    raise UserError(f"tool_choice: expected one of {', '.join(TOOL_CHOICES)} or "
                    f"{{'type': 'function', 'function': {{'name': ...}}}}, got {tool_choice!r:.80}")


def template_message(message: Any, where: str) -> dict:
    """A chat message as the template wants it: an assistant's ``tool_calls`` arguments as objects
    (templates write them with ``tojson`` or ``.items()``), ``None`` content as ``""``."""
    if not isinstance(message, dict):
        raise UserError(f"{where}: expected a message object, got {message!r:.80}")
    message = dict(message)
    if message.get("content") is None:
        message["content"] = ""
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise UserError(f"{where}.tool_calls: expected a list of tool calls")
        fixed = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise UserError(f"{where}.tool_calls.{j}.function: expected {{'name': ..., 'arguments': ...}}")
            arguments = fn.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments) if arguments.strip() else {}
                except ValueError:
                    raise UserError(f"{where}.tool_calls.{j}.function.arguments: expected a JSON object, got {arguments!r:.80}") from None
            if not isinstance(arguments, dict):
                raise UserError(f"{where}.tool_calls.{j}.function.arguments: expected a JSON object, got {arguments!r:.80}")
            fixed.append({**call, "type": "function", "function": {**fn, "arguments": arguments}})
        message["tool_calls"] = fixed
    return message


def special_token_texts(tokenizer) -> set[str]:
    """The text of every special token (a grammar names these as tokens, not as text)."""
    ids = getattr(tokenizer, "special_token_ids", ()) or ()
    return {t for t in (tokenizer.id_to_token(i) for i in ids) if t}


def prepare_chat(
    tokenizer,
    chat_format: ChatFormat | None,
    messages: list[dict],
    params: SamplingParams,
    *,
    tools: list[dict] | None = None,
    tool_choice: Any = None,
    parallel_tool_calls: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> ChatPlan:
    """Render ``messages`` (with ``tools``) and set up the request's constraint and parsing."""
    kwargs = dict(chat_template_kwargs or {})
    for key in RESERVED_TEMPLATE_KWARGS:
        if key in kwargs:
            raise UserError(f"chat_template_kwargs.{key}: set by the request itself, not through chat_template_kwargs")
    schemas: dict[str, dict] = {}
    if tools is not None:
        if not isinstance(tools, list):
            raise UserError("tools: expected a list of {'type': 'function', 'function': {...}}")
        schemas = dict(tool_function(tool, f"tools.{i}") for i, tool in enumerate(tools))
    choice = ("auto" if tools else "none") if tool_choice is None else tool_choice
    name = None if isinstance(choice, str) and choice in TOOL_CHOICES else named_choice(choice)
    if choice != "none" and not tools:
        raise UserError(f"tool_choice: {choice!r} needs tools")
    if tools and choice != "none" and chat_format is None:
        raise UserError("tools: this model's architecture registers no chat format, so its tool calls cannot be "
                        "parsed (use tool_choice 'none', or a plugin that registers one: register_chat_formats)")
    if not isinstance(parallel_tool_calls, bool):
        raise UserError(f"parallel_tool_calls: expected true or false, got {parallel_tool_calls!r:.40}")
    chat = [template_message(m, f"messages.{i}") for i, m in enumerate(messages)] if isinstance(messages, list) else messages
    prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tools=tools or None, **kwargs)
    reasoning_open = chat_format.reasoning_open(prompt) if chat_format is not None else False
    parse_tools = bool(tools) and choice != "none"
    eos_texts: tuple[str, ...] = ()
    if parse_tools and chat_format.needs_special_tokens:
        params = attrs.evolve(params, skip_special_tokens=False)  # the markers are special tokens
        eos_ids = getattr(tokenizer, "eos_token_ids", ()) or ()
        eos_texts = tuple(t for t in (tokenizer.id_to_token(i) for i in eos_ids) if t)
    if choice == "required" or name is not None:
        if params.structured_outputs is not None:
            raise UserError(f"tool_choice: {choice!r:.60} constrains the output, and so does the request's "
                            "response_format / structured_outputs; give one of them")
        grammar = chat_format.tool_call_grammar(tools, parallel=parallel_tool_calls, name=name,
                                                special_tokens=special_token_texts(tokenizer),
                                                reasoning_open=reasoning_open)
        try:
            constraint = StructuredOutputsParams(grammar=grammar)
        except UserError as exc:
            raise UserError(f"tools: a tool's parameters schema cannot be enforced: {' '.join(str(exc).split())}") from None
        # The grammar closes an opened reasoning before the call, or writes none: within any
        # thinking budget by construction (and a budget beside a grammar is refused)
        params = attrs.evolve(params, structured_outputs=constraint, thinking_token_budget=None)
    return ChatPlan(prompt=prompt, params=params, chat_format=chat_format, parse_tools=parse_tools,
                    reasoning_open=reasoning_open, eos_texts=eos_texts, schemas=schemas)
