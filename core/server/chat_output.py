"""A chat completion's text as the APIs answer it: OpenAI's ``message`` (``content``,
``reasoning_content``, ``tool_calls``) and chunk deltas, Anthropic's content blocks (``thinking``,
``text``, ``tool_use``) and their stream events, all read through the request's `ChatPlan`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from layerzoo.entrypoints.chat import ChatPlan
from layerzoo.tokenization.chat_formats import ParsedMessage, StreamEvent, StreamParser


def openai_message(parsed: ParsedMessage) -> dict[str, Any]:
    """OpenAI's assistant ``message``: ``reasoning_content`` and ``tool_calls`` only when present."""
    message: dict[str, Any] = {"role": "assistant", "content": parsed.content}
    if parsed.reasoning_content is not None:
        message["reasoning_content"] = parsed.reasoning_content
    if parsed.tool_calls:
        message["tool_calls"] = [call.openai() for call in parsed.tool_calls]
    return message


def openai_finish(reason: str | None, called: bool) -> str | None:
    """``"tool_calls"`` for a message that ended on its own after calling tools."""
    return "tool_calls" if called and reason == "stop" else reason


class ChoiceStreams:
    """The stream parsers of a chat request's choices: text snapshots in, OpenAI deltas out."""

    def __init__(self, plan: ChatPlan):
        self.plan = plan
        self.parsers: dict[int, StreamParser | None] = {}
        self.sent: dict[int, int] = {}
        self.called: set[int] = set()

    def events(self, index: int, text: str, finished: bool) -> list[StreamEvent]:
        """The events of choice ``index`` whose whole text so far is ``text``."""
        if index not in self.parsers:
            self.parsers[index], self.sent[index] = self.plan.stream(), 0
        text = self.plan.visible(text, finished)
        new, self.sent[index] = text[self.sent[index]:], len(text)
        parser = self.parsers[index]
        if parser is None:
            return [StreamEvent("content", new)] if new else []
        events = parser.feed(new) + (parser.finish() if finished else [])
        if any(e.kind == "tool_call" for e in events):
            self.called.add(index)
        return events

    def deltas(self, index: int, text: str, finished: bool) -> list[dict[str, Any]]:
        return [d for e in self.events(index, text, finished) for d in e.openai_deltas()]


# -- Anthropic ------------------------------------------------------------------------------------


def tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def anthropic_content(events: list[StreamEvent]) -> list[dict[str, Any]]:
    """Anthropic content blocks of a finished output's events, in their order (what the
    streamed blocks of `AnthropicBlocks` add up to): consecutive reasoning one ``thinking`` block,
    consecutive content one ``text`` block, each call a ``tool_use``; an empty text block when
    nothing was said at all."""
    blocks: list[dict[str, Any]] = []
    for e in events:
        if e.kind == "tool_call":
            blocks.append({"type": "tool_use", "id": tool_use_id(), "name": e.call.name, "input": json.loads(e.call.arguments)})
            continue
        kind = "thinking" if e.kind == "reasoning" else "text"
        if not blocks or blocks[-1]["type"] != kind:
            blocks.append({"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""})
        blocks[-1][kind] += e.text
    return blocks or [{"type": "text", "text": ""}]


class AnthropicBlocks:
    """Stream events become Anthropic's ``content_block_start`` / ``_delta`` / ``_stop`` events;
    a block closes when the next kind begins. Each item out is ``(event name, data)``."""

    KINDS = {"reasoning": "thinking", "content": "text"}

    def __init__(self):
        self.index = -1
        self.open: str | None = None
        self.tool_calls = 0

    def _start(self, block: dict[str, Any]) -> list[tuple[str, dict]]:
        out = self.close()
        self.index += 1
        self.open = block["type"]
        return out + [("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[tuple[str, dict]]:
        if self.open is None:
            return []
        self.open = None
        return [("content_block_stop", {"index": self.index})]

    def events(self, events: list[StreamEvent]) -> list[tuple[str, dict]]:
        out: list[tuple[str, dict]] = []
        for e in events:
            if e.kind == "tool_call":
                self.tool_calls += 1
                out += self._start({"type": "tool_use", "id": tool_use_id(), "name": e.call.name, "input": {}})
                out.append(("content_block_delta", {"index": self.index, "delta": {
                    "type": "input_json_delta", "partial_json": e.call.arguments}}))
                out += self.close()
                continue
            kind = self.KINDS[e.kind]
            if self.open != kind:
                empty = {"type": "thinking", "thinking": "", "signature": ""} if kind == "thinking" else {"type": "text", "text": ""}
                out += self._start(empty)
            delta = {"type": "thinking_delta", "thinking": e.text} if kind == "thinking" else {"type": "text_delta", "text": e.text}
            out.append(("content_block_delta", {"index": self.index, "delta": delta}))
        return out

    def finish(self) -> list[tuple[str, dict]]:
        """The last block's stop (an empty text block if nothing was said at all)."""
        out = self._start({"type": "text", "text": ""}) if self.index < 0 else []
        return out + self.close()
