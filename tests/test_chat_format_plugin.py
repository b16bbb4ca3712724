"""A third-party plugin's chat format (the ``register_chat_formats`` hook), as docs/writing-a-plugin.md
shows it: a plugin registered through pluggy serves a new architecture and says how its models
write tool calls (``[[call NAME {json}]]``); ``LLM.chat`` and the server (in process) parse
and constrain with it."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

pytest.importorskip("torch")
httpx = pytest.importorskip("httpx")

from layerzoo import LLM, hookimpl  # noqa: E402
from layerzoo.loading.model_packages import DEFAULT_MODEL  # noqa: E402
from layerzoo.sampling import SamplingParams  # noqa: E402
from layerzoo.testing import registered_plugin  # noqa: E402
from layerzoo.tokenization.chat_formats import ChatFormat, json_item, lark_literal  # noqa: E402

ARCHITECTURE = "ToyChatForCausalLM"
TOOLS = [{"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"tz": {"enum": ["UTC", "CET"]}}, "required": ["tz"]}}}]


class BracketFormat(ChatFormat):
    """Calls as ``[[call NAME {json arguments}]]``; no reasoning."""

    name = "brackets"
    reasoning = None
    block = ("[[call ", "]]")

    def parse_block(self, body):
        m = re.fullmatch(r"(\w+) (\{.*\})", body, re.S)
        if m is None:
            return None
        try:
            args = json.loads(m.group(2))
        except ValueError:
            return None
        return [(None, m.group(1), json.dumps(args))] if isinstance(args, dict) else None

    def call_grammar(self, functions, parallel, marker):
        calls = [f"call{i}: {marker(self.block[0])} {lark_literal(name + ' ')} args{i} {marker(self.block[1])}\n"
                 f"args{i}: {json_item(params)}" for i, (name, params) in enumerate(functions)]
        return "start: call\ncall: " + " | ".join(f"call{i}" for i in range(len(functions))) + "\n" + "\n".join(calls) + "\n"


class ToyPlugin:
    @hookimpl
    def register_architectures(self, register):
        register(ARCHITECTURE, "layerzoo_qwen3.model:Qwen3ForCausalLM")

    @hookimpl
    def register_chat_formats(self, register):
        register(ARCHITECTURE, BracketFormat())


@pytest.fixture(scope="module")
def toy_llm(tmp_path_factory):
    pytest.importorskip("layerzoo_qwen3")
    path = tmp_path_factory.mktemp("toy-chat")
    # The base model only: the MTP head the embedded model ships is the qwen3 plugin's to map.
    head = {"config.json", "mtp.safetensors", "model.safetensors.index.json"}
    for f in DEFAULT_MODEL.iterdir():
        if f.name not in head:
            (path / f.name).symlink_to(f)
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    config.pop("mtp_num_hidden_layers", None)
    (path / "config.json").write_text(json.dumps({**config, "architectures": [ARCHITECTURE]}))
    with registered_plugin(ToyPlugin(), "toy-chat-plugin"):
        llm = LLM(str(path))
        yield llm


def test_the_plugins_format_parses_and_constrains_llm_chat(toy_llm):
    messages = [{"role": "user", "content": "What time is it?"}]
    for seed in (1, 2):
        (out,) = toy_llm.chat(messages, SamplingParams(max_tokens=60, temperature=1.0, seed=seed), tools=TOOLS,
                              tool_choice="required")
        c = out.outputs[0]
        assert c.text.startswith("[[call get_time {") and c.finish_reason == "stop", c.text
        (call,) = c.tool_calls
        assert call.name == "get_time" and json.loads(call.arguments)["tz"] in ("UTC", "CET")
        assert c.content is None and c.reasoning_content is None


def test_the_server_uses_the_plugins_format(toy_llm):
    from layerzoo.entrypoints.async_llm import AsyncLLM
    from layerzoo.server.app import ServerConfig, build_app

    engine = AsyncLLM.from_engine(toy_llm.engine, toy_llm.tokenizer)
    app = build_app(engine, ServerConfig(model_name="toy"))
    body = {"messages": [{"role": "user", "content": "Time?"}], "tools": TOOLS, "tool_choice": "required",
            "max_tokens": 60, "temperature": 0}

    async def ask():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://toy") as client:
            plain = (await client.post("/v1/chat/completions", json=body)).json()
            streamed = (await client.post("/v1/chat/completions", json={**body, "stream": True})).text
        return plain, streamed

    try:
        plain, streamed = asyncio.run(ask())
    finally:
        engine.shutdown()
    choice = plain["choices"][0]
    (call,) = choice["message"]["tool_calls"]
    assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_time"
    chunks = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    deltas = [tc for c in chunks for ch in c["choices"] for tc in ch["delta"].get("tool_calls", [])]
    assert deltas[0]["function"] == {"name": "get_time", "arguments": ""}
    assert "".join(d["function"]["arguments"] for d in deltas) == call["function"]["arguments"]
    assert not any("[[" in (ch["delta"].get("content") or "") for c in chunks for ch in c["choices"])


def test_a_thinking_budget_is_refused_for_a_format_without_reasoning(toy_llm):
    from layerzoo.entrypoints.async_llm import AsyncLLM
    from layerzoo.errors import UserError
    from layerzoo.server.app import ServerConfig, build_app

    with pytest.raises(UserError, match="SamplingParams.thinking_token_budget: ToyChatForCausalLM has no chat format with reasoning"):
        toy_llm.generate("Hello", SamplingParams(max_tokens=4, thinking_token_budget=8))
    engine = AsyncLLM.from_engine(toy_llm.engine, toy_llm.tokenizer)
    app = build_app(engine, ServerConfig(model_name="toy"))

    async def ask():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://toy") as client:
            anthropic = await client.post("/v1/messages", json={"max_tokens": 16, "messages": [{"role": "user", "content": "Hi"}],
                                                                "thinking": {"type": "enabled", "budget_tokens": 8}})
            openai = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}],
                                                                     "max_tokens": 16, "thinking_token_budget": 8})
        return anthropic, openai

    try:
        anthropic, openai = asyncio.run(ask())
    finally:
        engine.shutdown()
    assert anthropic.status_code == 400 and anthropic.json()["error"]["message"].startswith("thinking.budget_tokens: ")
    assert openai.status_code == 400 and openai.json()["error"]["param"] == "thinking_token_budget"
