"""Chat formats: how a model writes tool calls and reasoning into its text, and how to read them back.

A `ChatFormat` is registered per architecture by the plugin that serves it (the
``register_chat_formats`` hook, `chat_format_for`). The core uses it three ways:

- `ChatFormat.parse(text)`: a finished completion split into ``content``, ``reasoning_content``
  and ``tool_calls`` (`ParsedMessage`);
- `ChatFormat.stream()`: the same split made incrementally (`StreamParser`): feed text deltas,
  get content / reasoning / tool-call events as OpenAI streams them. ``parse`` *is* the stream
  parser fed the whole text at once, so a stream split anywhere reassembles to the one-shot parse;
  text that may still become a marker (``"<tool_"``) is held back, never sent as content;
- `ChatFormat.tool_call_grammar(tools, ...)`: an llguidance Lark grammar whose every sentence is one
  (or, with ``parallel``, several) tool calls in this format, with arguments valid for the tool's
  ``parameters`` schema: ``tool_choice`` ``"required"`` / named constrains generation with it.

The formats here: ``hermes`` (Qwen3, Qwen2, Qwen3-Next: ``<tool_call>\\n{"name": ..., "arguments":
{...}}\\n</tool_call>``), ``glm`` (GLM-4.5 and later: ``<tool_call>name<arg_key>k</arg_key>
<arg_value>v</arg_value></tool_call>``), ``kimi`` (Kimi K2 and later: the tool-call section tokens),
``llama3_json`` (Llama 3.1+: the whole message is ``{"name": ..., "parameters": {...}}``, maybe
after ``<|python_tag|>``), ``qwen3_coder`` (Qwen3-Coder, Qwen3.5: ``<tool_call>\\n<function=name>\\n
<parameter=k>\\nv\\n</parameter>\\n</function>\\n</tool_call>``, values typed by the tool's schema).
All but ``llama3_json`` split ``<think>...</think>`` into reasoning.
A plugin may subclass `ChatFormat` for a format of its own (docs/writing-a-plugin.md).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable, Iterable
from typing import Any

import attrs

from layerzoo.errors import UserError

# Calls one constrained message may hold with parallel_tool_calls: bounded, so a weak model cannot
# chain calls until max_tokens.
MAX_PARALLEL_CALLS = 8


def new_call_id() -> str:
    """An OpenAI-style tool call id (``call_`` and 24 hex digits)."""
    return f"call_{uuid.uuid4().hex[:24]}"


@attrs.frozen
class ToolCall:
    """One parsed call: ``arguments`` is JSON text (OpenAI's shape), an object's."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@attrs.frozen
class ParsedMessage:
    """A completion's text split by its chat format. ``reasoning_content`` is None when the text
    had no reasoning; ``content`` is None when the message is only reasoning and tool calls."""

    content: str | None
    reasoning_content: str | None
    tool_calls: list[ToolCall] = attrs.field(factory=list)


@attrs.frozen
class StreamEvent:
    """What a stream parser found in the text fed so far: ``kind`` is ``"content"``,
    ``"reasoning"`` (with ``text``) or ``"tool_call"`` (with ``call`` and its ``index``)."""

    kind: str
    text: str = ""
    call: ToolCall | None = None
    index: int = 0

    def openai_deltas(self) -> list[dict[str, Any]]:
        """This event as OpenAI chat-completion chunk deltas: a tool call is one delta with its
        index, id, type, name and empty arguments, then one with the arguments."""
        if self.kind == "content":
            return [{"content": self.text}]
        if self.kind == "reasoning":
            return [{"reasoning_content": self.text}]
        head = {"index": self.index, "id": self.call.id, "type": "function",
                "function": {"name": self.call.name, "arguments": ""}}
        deltas = [{"tool_calls": [head]}]
        if self.call.arguments:
            deltas.append({"tool_calls": [{"index": self.index, "function": {"arguments": self.call.arguments}}]})
        return deltas


def _held(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could be the start of ``marker``."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _arguments_json(value: Any) -> str | None:
    """A call's arguments as JSON text of an object: a dict, or text that parses to one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return None
    return json.dumps(value, ensure_ascii=False) if isinstance(value, dict) else None


def lark_literal(text: str) -> str:
    """``text`` as a Lark string literal."""
    return json.dumps(text, ensure_ascii=False)


def tool_function(tool: Any, where: str) -> tuple[str, dict]:
    """``(name, parameters schema)`` of an OpenAI tool ``{"type": "function", "function": {...}}``."""
    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise UserError(f"{where}: expected {{'type': 'function', 'function': {{'name': ..., 'parameters': {{...}}}}}}")
    params = fn.get("parameters")
    if params is None:
        params = {"type": "object", "properties": {}}
    if not isinstance(params, dict):
        raise UserError(f"{where}.function.parameters: expected a JSON schema (an object), got {params!r:.80}")
    return fn["name"], params


class ChatFormat:
    """How one family of models writes tool calls and reasoning.

    Subclasses set the class attributes and implement `parse_block` and `call_grammar`:

    - ``name``: what a plugin may register instead of an instance (``"hermes"``).
    - ``reasoning``: ``(start, end)`` markers of the reasoning at the start of the output
      (``("<think>", "</think>")``), or None.
    - ``block``: ``(start, end)`` markers around tool calls in the text, or None.
    - ``whole_message_starts``: for formats where a call is the whole message (Llama 3 JSON), the
      texts such a message starts with; the output is then held until it ends.
    - ``needs_special_tokens``: the markers are special tokens, so a request with tools keeps
      special tokens in its text (``SamplingParams(skip_special_tokens=False)``).
    """

    name: str = ""
    reasoning: tuple[str, str] | None = ("<think>", "</think>")
    block: tuple[str, str] | None = None
    whole_message_starts: tuple[str, ...] = ()
    needs_special_tokens: bool = False

    def parse_block(self, body: str) -> list[tuple[str | None, str, str]] | None:
        """The calls in one block's inner text as ``(id or None, name, arguments JSON)``, or None
        when the text is no valid call (it is then kept as content)."""
        raise NotImplementedError

    def parse_calls(self, body: str, schemas: dict[str, dict]) -> list[tuple[str | None, str, str]] | None:
        """`parse_block` given the request's tools (``schemas``: name -> parameters schema), for
        formats whose text does not say a value's type (Qwen3-Coder's XML); others ignore them."""
        return self.parse_block(body)

    def call_grammar(self, functions: list[tuple[str, dict]], parallel: bool, marker: Callable[[str], str]) -> str:
        """The Lark grammar (``start`` rule) of one call, or several when ``parallel``, to one of
        ``functions`` (``(name, parameters schema)``); ``marker(text)`` is a marker as a Lark item
        (a special-token reference where the tokenizer has it as a special token)."""
        raise NotImplementedError

    # -- the public surface ------------------------------------------------------------------

    def stream(self, *, reasoning_open: bool = False, tools: bool = True,
               make_id: Callable[[], str] = new_call_id, schemas: dict[str, dict] | None = None) -> StreamParser:
        """An incremental parser. ``reasoning_open``: the prompt ended inside the reasoning (the
        template opened ``<think>``); ``tools=False`` (no tools, or ``tool_choice: "none"``)
        leaves tool-call text as content; ``schemas``: the tools' parameters schemas by name."""
        return StreamParser(self, reasoning_open=reasoning_open, tools=tools, make_id=make_id, schemas=schemas)

    def parse(self, text: str, *, reasoning_open: bool = False, tools: bool = True,
              make_id: Callable[[], str] = new_call_id, schemas: dict[str, dict] | None = None) -> ParsedMessage:
        """A finished completion's text split into content, reasoning and tool calls."""
        parser = self.stream(reasoning_open=reasoning_open, tools=tools, make_id=make_id, schemas=schemas)
        return collect(parser.feed(text) + parser.finish())

    def reasoning_open(self, prompt: str) -> bool:
        """Whether ``prompt`` (the rendered chat) ends inside an opened reasoning block."""
        if self.reasoning is None:
            return False
        start, end = self.reasoning
        at = prompt.rfind(start)
        return at >= 0 and end not in prompt[at:] and not prompt[at + len(start):].strip()

    def tool_call_grammar(self, tools: list[dict], *, parallel: bool = True, name: str | None = None,
                          special_tokens: Iterable[str] = (), reasoning_open: bool = False) -> str:
        """The grammar for ``tool_choice`` ``"required"`` (any of ``tools``) or named (``name``).
        With ``reasoning_open`` the reasoning is closed first (a forced call has no thinking)."""
        functions = [tool_function(tool, f"tools.{i}") for i, tool in enumerate(tools)]
        if name is not None:
            functions = [f for f in functions if f[0] == name]
            if not functions:
                raise UserError(f"tool_choice.function.name: no tool named {name!r} in tools")
        special = set(special_tokens)

        def marker(text: str) -> str:
            return text if text in special else lark_literal(text)

        grammar = self.call_grammar(functions, parallel, marker)
        if reasoning_open and self.reasoning is not None:
            grammar = grammar.replace("start:", f"start: {marker(self.reasoning[1])} \"\\n\\n\" calls\ncalls:", 1)
        return grammar


def collect(events: Iterable[StreamEvent]) -> ParsedMessage:
    """The message a list of stream events makes."""
    content, reasoning, calls, saw_reasoning = [], [], [], False
    for e in events:
        if e.kind == "content":
            content.append(e.text)
        elif e.kind == "reasoning":
            saw_reasoning = True
            reasoning.append(e.text)
        else:
            calls.append(e.call)
    text = "".join(content)
    return ParsedMessage(content=text if text or not (calls or saw_reasoning) else None,
                         reasoning_content="".join(reasoning) if saw_reasoning else None, tool_calls=calls)


class StreamParser:
    """Splits text fed in pieces; `feed` and `finish` return `StreamEvent` lists.

    States: ``start`` (might a reasoning block or a whole-message call begin?), ``reasoning``,
    ``content``, ``block`` (inside a tool-call block, held until it closes) and ``whole``
    (a whole-message call, held until the end). Whitespace right after ``</think>`` or after a
    tool call is dropped.
    """

    def __init__(self, fmt: ChatFormat, *, reasoning_open: bool, tools: bool, make_id: Callable[[], str],
                 schemas: dict[str, dict] | None = None):
        self.fmt, self.tools, self.make_id = fmt, tools, make_id
        self.schemas = schemas or {}
        self.buf = ""
        self.mode = "reasoning" if reasoning_open and fmt.reasoning else "start"
        self.strip = False  # drop leading whitespace of the next content
        self.calls = 0
        self.sent_reasoning = False

    # -- events

    def _content(self, text: str, out: list[StreamEvent]) -> None:
        if self.strip:
            text = text.lstrip()
            self.strip = not text
        if text:
            out.append(StreamEvent("content", text))

    def _reasoning(self, text: str, out: list[StreamEvent]) -> None:
        if text:
            self.sent_reasoning = True
            out.append(StreamEvent("reasoning", text))

    def _block(self, body: str, out: list[StreamEvent], closed: bool) -> None:
        start, end = self.fmt.block
        calls = self.fmt.parse_calls(body, self.schemas)
        if not calls:
            self._content(start + body + (end if closed else ""), out)
            return
        for call_id, name, arguments in calls:
            out.append(StreamEvent("tool_call", call=ToolCall(call_id or self.make_id(), name, arguments), index=self.calls))
            self.calls += 1
        self.strip = True

    # -- feeding

    def feed(self, text: str) -> list[StreamEvent]:
        self.buf += text
        out: list[StreamEvent] = []
        while self._step(out):
            pass
        return out

    def finish(self) -> list[StreamEvent]:
        """The events of the text still held, at the end of the output."""
        out: list[StreamEvent] = []
        buf, self.buf = self.buf, ""
        if self.mode == "reasoning":
            self._reasoning(buf, out)
        elif self.mode == "block":
            self._block(buf, out, closed=False)
        elif self.mode == "whole":
            calls = self.fmt.parse_calls(buf, self.schemas)
            if calls:
                for call_id, name, arguments in calls:
                    out.append(StreamEvent("tool_call", call=ToolCall(call_id or self.make_id(), name, arguments), index=self.calls))
                    self.calls += 1
            else:
                self._content(buf, out)
        else:
            self._content(buf, out)
        self.mode = "done"
        return out

    def _step(self, out: list[StreamEvent]) -> bool:
        """One transition on the buffer; False when it must wait for more text."""
        fmt, buf = self.fmt, self.buf
        if self.mode == "start":
            head = buf.lstrip()
            starts = ([fmt.reasoning[0]] if fmt.reasoning else []) + (list(fmt.whole_message_starts) if self.tools else [])
            for marker in starts:
                if head.startswith(marker):
                    if fmt.reasoning and marker == fmt.reasoning[0]:
                        self.buf, self.mode = head[len(marker):], "reasoning"
                        self.strip = True  # the reasoning's leading newline
                    else:
                        self.mode = "whole"
                    return True
            if any(m.startswith(head) for m in starts):
                return False  # "", "<th": may still become a marker
            self.mode = "content"
            return True
        if self.mode == "reasoning":
            end = fmt.reasoning[1]
            at = buf.find(end)
            if at >= 0:
                self._reasoning(self._lstrip_reasoning(buf[:at]), out)
                self.buf, self.mode, self.strip = buf[at + len(end):], "content", True
                return True
            keep = _held(buf, end)
            self._reasoning(self._lstrip_reasoning(buf[: len(buf) - keep]), out)
            self.buf = buf[len(buf) - keep:]
            return False
        if self.mode == "content":
            if not self.tools or fmt.block is None:
                self._content(buf, out)
                self.buf = ""
                return False
            start = fmt.block[0]
            at = buf.find(start)
            if at >= 0:
                self._content(buf[:at], out)
                self.buf, self.mode = buf[at + len(start):], "block"
                return True
            keep = _held(buf, start)
            self._content(buf[: len(buf) - keep], out)
            self.buf = buf[len(buf) - keep:]
            return False
        if self.mode == "block":
            end = fmt.block[1]
            at = buf.find(end)
            if at < 0:
                return False
            self._block(buf[:at], out, closed=True)
            self.buf, self.mode = buf[at + len(end):], "content"
            return True
        return False  # whole / done: everything waits for finish()

    def _lstrip_reasoning(self, text: str) -> str:
        # The whitespace right after <think> is layout, not reasoning (held until text comes).
        if self.strip and not self.sent_reasoning:
            text = text.lstrip()
            if not text:
                return ""
            self.strip = False
        return text


# ---------------------------------------------------------------------------------------------
# The formats.
# ---------------------------------------------------------------------------------------------


def _call_schema(name: str, params: dict, args_key: str) -> dict:
    return {"type": "object", "properties": {"name": {"const": name}, args_key: params},
            "required": ["name", args_key], "additionalProperties": False}


def json_item(schema: dict) -> str:
    """``%json {schema}``: compact JSON (no free whitespace for a weak model to loop in), and objects
    without ``additionalProperties`` closed (a call's arguments are the tool's parameters, no more)."""
    from layerzoo.runtime.structured_outputs import _closed_objects

    closed = _closed_objects(schema)
    return "%json " + json.dumps({**closed, "x-guidance": {"whitespace_flexible": False}}, ensure_ascii=False)


class HermesFormat(ChatFormat):
    """Qwen3, Qwen2.5, Qwen3-Next (Hermes-style): ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>``."""

    name = "hermes"
    block = ("<tool_call>", "</tool_call>")
    args_key = "arguments"

    def parse_block(self, body):
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = _arguments_json(call.get(self.args_key, call.get("parameters", {})))
        return None if arguments is None else [(None, call["name"], arguments)]

    def call_grammar(self, functions, parallel, marker):
        schema = {"anyOf": [_call_schema(n, p, self.args_key) for n, p in functions]}
        start, end = self.block
        many = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        return (f"start: call{many}\n"
                f"call: {marker(start)} \"\\n\" body \"\\n\" {marker(end)}\n"
                f"body: {json_item(schema)}\n")


class GlmFormat(ChatFormat):
    """GLM-4.5 and later (GLM-5): ``<tool_call>name\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...</tool_call>``.
    A value is JSON-decoded when it parses, else it is the string as written."""

    name = "glm"
    block = ("<tool_call>", "</tool_call>")
    _pair = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)

    def parse_block(self, body):
        head, _, rest = body.partition("<arg_key>")
        name = head.strip()
        rest = "<arg_key>" + rest if rest else ""
        if not name or any(c in name for c in "<>{}\n"):
            return None
        args, at = {}, 0
        for m in self._pair.finditer(rest):
            if rest[at:m.start()].strip():
                return None
            args[m.group(1).strip()] = argument_value(m.group(2), None)
            at = m.end()
        if rest[at:].strip():
            return None
        return [(None, name, json.dumps(args, ensure_ascii=False))]

    def call_grammar(self, functions, parallel, marker):
        def argument(fname, key, schema):
            return f"{lark_literal(f'<arg_key>{key}</arg_key>' + chr(10) + '<arg_value>')} {json_item(schema)} \"</arg_value>\\n\""

        return keyed_call_grammar(functions, parallel, marker, self.block, lambda fname: lark_literal(fname + chr(10)), argument)


class KimiFormat(ChatFormat):
    """Kimi K2 and later: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.name:0
    <|tool_call_argument_begin|>{json}<|tool_call_end|>...<|tool_calls_section_end|>``; the call id
    is the text's ``functions.name:0``."""

    name = "kimi"
    block = ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>")
    needs_special_tokens = True
    _call = re.compile(r"<\|tool_call_begin\|>\s*([^\s<]+?)\s*<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.S)
    _id = re.compile(r"(?:functions\.)?(.+):\d+")

    def parse_block(self, body):
        calls, at = [], 0
        for m in self._call.finditer(body):
            if body[at:m.start()].strip():
                return None
            named = self._id.fullmatch(m.group(1))
            arguments = _arguments_json(m.group(2))
            if named is None or arguments is None:
                return None
            calls.append((m.group(1), named.group(1), arguments))
            at = m.end()
        if body[at:].strip():
            return None
        return calls or None

    def call_grammar(self, functions, parallel, marker):
        calls = []
        for i, (fname, params) in enumerate(functions):
            calls.append(f"call{i}: {marker('<|tool_call_begin|>')} {lark_literal('functions.' + fname + ':')} /[0-9]{{1,3}}/ "
                         f"{marker('<|tool_call_argument_begin|>')} args{i} {marker('<|tool_call_end|>')}")
            calls.append(f"args{i}: {json_item(params)}")
        alternatives = " | ".join(f"call{i}" for i in range(len(functions)))
        return "\n".join([f"start: {marker(self.block[0])} call{f'{{1,{MAX_PARALLEL_CALLS}}}' if parallel else ''} {marker(self.block[1])}",
                          f"call: {alternatives}", *calls]) + "\n"


class Llama3JsonFormat(ChatFormat):
    """Llama 3.1 and later, JSON tool calling: the whole message is ``{"name": "f", "parameters":
    {...}}`` (or several joined by ``;``), maybe after ``<|python_tag|>``. No reasoning."""

    name = "llama3_json"
    reasoning = None
    whole_message_starts = ("{", "<|python_tag|>")

    def parse_block(self, body):
        text = body.strip().removeprefix("<|python_tag|>").strip()
        decoder, calls, at = json.JSONDecoder(), [], 0
        while at < len(text):
            try:
                call, at = decoder.raw_decode(text, at)
            except ValueError:
                return None
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            arguments = _arguments_json(call.get("parameters", call.get("arguments", {})))
            if arguments is None:
                return None
            calls.append((None, call["name"], arguments))
            rest = text[at:].lstrip()
            if rest.startswith(";"):
                rest = rest[1:].lstrip()
            elif rest:
                return None
            at = len(text) - len(rest)
        return calls or None

    def call_grammar(self, functions, parallel, marker):
        schema = {"anyOf": [_call_schema(n, p, "parameters") for n, p in functions]}
        many = f' ("; " call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
        return f"start: call{many}\ncall: {json_item(schema)}\n"


class Qwen3CoderFormat(ChatFormat):
    """Qwen3-Coder and Qwen3.5 (vLLM's ``qwen3_coder``): XML calls,
    ``<tool_call>\n<function=NAME>\n<parameter=ARG>\nVALUE\n</parameter>\n...</function>\n</tool_call>``.

    The text does not say a value's type; the tool's schema does: a string parameter's value is
    the text as written, any other is JSON (the text as a string where it is no JSON, as vLLM
    degrades). A parameter the request's tools do not describe is JSON where it parses, else text.
    In a forced call a string value holds no ``<`` (its regex cannot run into the closing tag).
    """

    name = "qwen3_coder"
    block = ("<tool_call>", "</tool_call>")
    _function = re.compile(r"\s*<function=([^>\n]+)>(.*)</function>\s*", re.S)
    _param = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.S)
    # String keywords a forced value's regex enforces (others cannot be, and are refused by name)
    _string_keywords = {"type", "description", "title", "enum", "const", "minLength", "maxLength", "pattern", "default", "examples"}

    def parse_block(self, body):
        return self.parse_calls(body, {})

    def parse_calls(self, body, schemas):
        m = self._function.fullmatch(body)
        if m is None:
            return None
        name, rest = m.group(1).strip(), m.group(2)
        props = (schemas.get(name) or {}).get("properties") or {}
        args, at = {}, 0
        for p in self._param.finditer(rest):
            if rest[at:p.start()].strip():
                return None
            key = p.group(1).strip()
            args[key] = argument_value(p.group(2), props.get(key))
            at = p.end()
        if rest[at:].strip() or not name:
            return None
        return [(None, name, json.dumps(args, ensure_ascii=False))]

    def call_grammar(self, functions, parallel, marker):
        def argument(fname, key, schema):
            head = f"<parameter={key}>\n"
            if is_string_schema(schema):
                # one regex lexeme from tag to tag: the value cannot swallow the closing tag's newline
                return (f"/{regex_text(head)}{self._string_regex(fname, key, schema)}"
                        f"{regex_text(chr(10) + '</parameter>' + chr(10))}/")
            return f"{lark_literal(head)} {json_item(schema)} \"\\n</parameter>\\n\""

        return keyed_call_grammar(functions, parallel, marker, self.block,
                                  lambda fname: lark_literal(chr(10) + f"<function={fname}>" + chr(10)), argument,
                                  tail='"</function>\\n"')

    def _string_regex(self, fname: str, key: str, schema: dict) -> str:
        """The regex (no anchors) of a string parameter's value under ``schema``."""
        unknown = sorted(set(schema) - self._string_keywords)
        if unknown:
            raise UserError(f"tools: {fname}.{key}: the string keyword(s) {', '.join(unknown)} cannot be enforced in "
                            f"{self.name}'s XML form (its values are raw text)")
        options = schema.get("enum", [schema["const"]] if "const" in schema else None)
        if options is not None:
            return "(?:" + "|".join(regex_text(str(o)) for o in options) + ")"
        if "pattern" in schema:  # (a slash ends a Lark regex literal: escaped)
            return "(?:" + re.sub(r"(?<!\\)/", r"\/", schema["pattern"].removeprefix("^").removesuffix("$")) + ")"
        low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
        return f"[^<]{{{low},{'' if high is None else int(high)}}}" if low or high is not None else "[^<]*"


def keyed_call_grammar(functions: list[tuple[str, dict]], parallel: bool, marker: Callable[[str], str],
                       block: tuple[str, str], head: Callable[[str], str],
                       argument: Callable[[str, str, dict], str], tail: str = "") -> str:
    """`ChatFormat.call_grammar` for formats that write each argument as its own tagged item (GLM's
    arg_key/arg_value, Qwen3-Coder's parameter tags): a call is ``block[0] head(name)`` then the
    function's arguments in schema order, each ``argument(name, key, schema)`` (a Lark expansion),
    the required ones always and the rest optional, then ``tail block[1]``."""
    rules, calls = [], []
    for i, (fname, params) in enumerate(functions):
        required = set(params.get("required") or [])
        items = []
        for j, (key, schema) in enumerate((params.get("properties") or {}).items()):
            rules.append(f"a{i}_{j}: {argument(fname, key, schema if isinstance(schema, dict) else {})}")
            items.append(f"a{i}_{j}" if key in required else f"a{i}_{j}?")
        calls.append(" ".join(filter(None, [f"call{i}: {marker(block[0])} {head(fname)}", *items, tail, marker(block[1])])))
    alternatives = " | ".join(f"call{i}" for i in range(len(functions)))
    many = f' ("\\n" call){{0,{MAX_PARALLEL_CALLS - 1}}}' if parallel else ""
    return "\n".join([f"start: call{many}", f"call: {alternatives}", *calls, *rules]) + "\n"


def argument_value(text: str, schema: Any) -> Any:
    """An argument written as text, as the tool's call gets it: the text itself for a string
    parameter (per its ``schema``), else JSON where it parses and the text where it does not."""
    if isinstance(schema, dict) and is_string_schema(schema):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def is_string_schema(schema: dict) -> bool:
    """Whether a parameter's value is text, not JSON: ``type: "string"``, or an enum / const of
    strings only with no type."""
    kind = schema.get("type")
    if kind is not None:
        return kind == "string"
    options = schema.get("enum", [schema["const"]] if "const" in schema else None)
    return bool(options) and all(isinstance(o, str) for o in options)


def regex_text(text: str) -> str:
    """``text`` as a regex matching it literally, fit for a Lark ``/.../`` literal (Rust regex
    syntax: its metacharacters and the slash escaped, a line break as ``\\n``)."""
    return "".join("\\n" if c == "\n" else "\\" + c if c in "\\.+*?()|[]{}^$#&-~/" else c for c in text)


BUILTIN_FORMATS: dict[str, ChatFormat] = {f.name: f for f in (HermesFormat(), GlmFormat(), KimiFormat(), Llama3JsonFormat(),
                                                                Qwen3CoderFormat())}


def as_chat_format(value: Any, where: str) -> ChatFormat:
    """A registered chat format: a `ChatFormat`, a built-in's name, or a ``"module:attr"`` string
    naming a `ChatFormat` instance or class."""
    if isinstance(value, ChatFormat):
        return value
    if isinstance(value, type) and issubclass(value, ChatFormat):
        return value()
    if isinstance(value, str) and value in BUILTIN_FORMATS:
        return BUILTIN_FORMATS[value]
    if isinstance(value, str) and ":" in value:
        from layerzoo.plugins.lazy import resolve_object

        return as_chat_format(resolve_object(value), where)
    known = ", ".join(sorted(BUILTIN_FORMATS))
    raise UserError(f"{where}: expected a ChatFormat, one of {known}, or 'module:attr'; got {value!r:.80}")
