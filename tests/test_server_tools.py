"""Tool calls and reasoning through `layerzoo serve` (issue 31): the official ``openai`` client and
Anthropic's Messages shape, on the embedded random-weight Qwen3 model (Hermes chat format) given
a Qwen3-style thinking template (``enable_thinking`` opens ``<think>`` in the prompt, as Qwen3's
thinking templates do). The model writes no call by itself: ``tool_choice`` ``required`` / named
make its grammar force one; the streamed deltas reassemble to the non-streamed message."""

from __future__ import annotations

import json
import shutil

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from layerzoo.chat import prepare_chat  # noqa: E402
from layerzoo.chat_formats import BUILTIN_FORMATS  # noqa: E402
from layerzoo.model_packages import DEFAULT_MODEL  # noqa: E402
from layerzoo.sampling import SamplingParams  # noqa: E402
from layerzoo.server.process import ServerProcess  # noqa: E402
from layerzoo.tokenizer import Tokenizer  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}}, "required": ["tz"]}}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
HISTORY = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
]
THINKING = """{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- else %}{{- '<think>\\n' }}{%- endif %}
{%- endif %}
"""


def fits(name: str, args: dict) -> bool:
    if name == "get_weather":
        return (set(args) == {"city", "days"} and isinstance(args["city"], str) and len(args["city"]) <= 12
                and type(args["days"]) is int and 1 <= args["days"] <= 7)
    return name == "get_time" and set(args) == {"tz"} and args["tz"] in ("UTC", "CET", "JST")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The embedded model with a thinking template (its generation prompt opens <think>)."""
    path = tmp_path_factory.mktemp("thinking-qwen3")
    for f in DEFAULT_MODEL.iterdir():
        if f.name != "tokenizer_config.json":
            (path / f.name).symlink_to(f)
    config = json.loads((DEFAULT_MODEL / "tokenizer_config.json").read_text())
    template = config["chat_template"]
    cut = template.index("{%- if add_generation_prompt %}")
    config["chat_template"] = template[:cut] + THINKING
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    with ServerProcess("--model", str(model_dir), "--served-model-name", "layerzoo") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def chat(client, stream=False, **kwargs):
    args = dict(model="layerzoo", messages=ASK, max_tokens=200, temperature=0, tools=TOOLS, stream=stream)
    return client.chat.completions.create(**{**args, **kwargs})


def reassembled(chunks) -> tuple[dict, str | None, list]:
    """The message a stream of chunks makes, its finish reason, and the tool-call deltas."""
    content, reasoning, calls, deltas, finish = "", "", {}, [], None
    for chunk in chunks:
        for choice in chunk.choices:
            d = choice.delta
            content += d.content or ""
            reasoning += getattr(d, "reasoning_content", None) or ""
            for tc in d.tool_calls or []:
                deltas.append(tc)
                call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
                call["id"] = call["id"] or tc.id
                if tc.function and tc.function.name:
                    call["name"] = tc.function.name
                call["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = choice.finish_reason or finish
    return {"content": content, "reasoning": reasoning, "calls": [calls[i] for i in sorted(calls)]}, finish, deltas


@pytest.mark.parametrize("thinking", [False, True])
def test_required_tool_choice_returns_a_call_and_the_stream_reassembles_to_it(client, thinking):
    extra = {} if thinking else NO_THINKING
    reply = chat(client, tool_choice="required", parallel_tool_calls=False, extra_body=extra)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert fits(call.function.name, json.loads(call.function.arguments)), call
    assert choice.message.content is None
    message, finish, deltas = reassembled(chat(client, stream=True, tool_choice="required", parallel_tool_calls=False, extra_body=extra))
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in message["calls"]] == [(call.function.name, call.function.arguments)]
    assert message["content"] == "" and message["reasoning"] == ""
    # OpenAI's shape: the first delta of a call has its id, type, name and empty arguments
    first = deltas[0]
    assert first.index == 0 and first.id and first.type == "function"
    assert first.function.name == call.function.name and first.function.arguments == ""
    assert all(d.id is None and d.function.name is None for d in deltas[1:])


def test_named_tool_choice_calls_that_tool(client):
    for seed in (1, 2, 3):
        reply = chat(client, tool_choice={"type": "function", "function": {"name": "get_time"}}, temperature=1.0,
                     seed=seed, extra_body=NO_THINKING)
        calls = reply.choices[0].message.tool_calls
        assert calls and all(c.function.name == "get_time" and fits("get_time", json.loads(c.function.arguments)) for c in calls)


def test_auto_and_none_leave_the_random_text_as_content(client):
    for choice in ("auto", "none"):
        reply = chat(client, tool_choice=choice, max_tokens=20, extra_body=NO_THINKING)
        message = reply.choices[0].message
        assert message.tool_calls is None and message.content and reply.choices[0].finish_reason == "length"


def test_reasoning_is_split_out_when_the_template_opens_thinking(client):
    # The random model never closes <think>: everything it writes is reasoning.
    reply = chat(client, max_tokens=20, tools=None)
    message = reply.choices[0].message
    assert message.reasoning_content and message.content is None
    streamed, _, _ = reassembled(chat(client, stream=True, max_tokens=20, tools=None))
    assert streamed["reasoning"] == message.reasoning_content and streamed["content"] == ""
    off = chat(client, max_tokens=20, tools=None, extra_body=NO_THINKING).choices[0].message
    assert off.content and getattr(off, "reasoning_content", None) is None


def test_the_template_receives_tools_and_tool_messages(client, model_dir):
    tokenizer = Tokenizer.from_dir(model_dir)
    plan = prepare_chat(tokenizer, BUILTIN_FORMATS["hermes"], HISTORY, SamplingParams(), tools=TOOLS,
                        chat_template_kwargs={"enable_thinking": False})
    assert json.dumps(TOOLS[0]) in plan.prompt  # the template's <tools> list (tojson)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n</tool_call>' in plan.prompt
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in plan.prompt
    assert plan.prompt.endswith("<think>\n\n</think>\n\n")
    reply = chat(client, messages=HISTORY, max_tokens=1, extra_body=NO_THINKING)
    assert reply.usage.prompt_tokens == len(tokenizer.encode(plan.prompt))


def test_bad_tool_fields_are_400s_naming_them(server):
    def post(body):
        return httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASK, **body}, timeout=60)

    cases = [
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice.function.name"),
        ({"tools": TOOLS, "tool_choice": "maybe"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools.0.function.name"),
        ({"messages": ASK + [{"role": "tool", "content": "x"}]}, "messages.1.tool_call_id"),
        ({"messages": ASK + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{no"}}]}]},
         "messages.1.tool_calls.0.function.arguments"),
        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs.messages"),
    ]
    for body, param in cases:
        r = post(body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


# -- Anthropic ------------------------------------------------------------------------------------

ANTHROPIC_TOOLS = [{"name": t["function"]["name"], "description": t["function"].get("description", ""),
                    "input_schema": t["function"]["parameters"]} for t in TOOLS]


def messages(server, **body):
    base = {"model": "layerzoo", "max_tokens": 200, "temperature": 0, "messages": [{"role": "user", "content": "Weather?"}]}
    return httpx.post(f"{server.url}/v1/messages", json={**base, **body}, timeout=120)


def events(server, **body) -> list[tuple[str, dict]]:
    r = messages(server, stream=True, **body)
    assert r.status_code == 200, r.text
    out = []
    for block in r.text.strip().split("\n\n"):
        name, data = block.split("\n", 1)
        out.append((name.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return out


def test_anthropic_tool_use_blocks_and_their_stream(server):
    body = {"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
            "thinking": {"type": "disabled"}}
    reply = messages(server, **body).json()
    assert reply["stop_reason"] == "tool_use", reply
    (block,) = reply["content"]
    assert block["type"] == "tool_use" and block["id"].startswith("toolu_") and fits(block["name"], block["input"])
    got = events(server, **body)
    starts = [d["content_block"] for n, d in got if n == "content_block_start"]
    assert [b["type"] for b in starts] == ["tool_use"] and starts[0]["name"] == block["name"] and starts[0]["input"] == {}
    partial = "".join(d["delta"]["partial_json"] for n, d in got if n == "content_block_delta")
    assert json.loads(partial) == block["input"]
    assert [n for n, _ in got][:3] == ["message_start", "content_block_start", "ping"]
    assert got[-2][1]["delta"]["stop_reason"] == "tool_use" and got[-1][0] == "message_stop"
    named = messages(server, tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "get_time"}).json()
    assert [b["name"] for b in named["content"] if b["type"] == "tool_use"][:1] == ["get_time"]


def test_anthropic_tool_results_reach_the_template(server, model_dir):
    history = [{"role": "user", "content": "What is the weather in Paris?"},
               {"role": "assistant", "content": [{"type": "tool_use", "id": "call_1", "name": "get_weather",
                                                  "input": {"city": "Paris", "days": 1}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1", "content": "Sunny, 21 C"}]}]
    reply = messages(server, messages=history, tools=ANTHROPIC_TOOLS, max_tokens=1, thinking={"type": "disabled"}).json()
    plan = prepare_chat(Tokenizer.from_dir(model_dir), BUILTIN_FORMATS["hermes"], HISTORY, SamplingParams(), tools=[
        {"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                          **({"description": t["description"]} if t["description"] else {})}}
        for t in ANTHROPIC_TOOLS], chat_template_kwargs={"enable_thinking": False})
    assert reply["usage"]["input_tokens"] == len(Tokenizer.from_dir(model_dir).encode(plan.prompt))


def test_anthropic_thinking_blocks_and_thinking_deltas(server):
    reply = messages(server, max_tokens=20, thinking={"type": "enabled", "budget_tokens": 10}).json()
    (block,) = reply["content"]
    assert block["type"] == "thinking" and block["thinking"]
    got = events(server, max_tokens=20, thinking={"type": "enabled", "budget_tokens": 10})
    assert [d["content_block"]["type"] for n, d in got if n == "content_block_start"] == ["thinking"]
    assert "".join(d["delta"]["thinking"] for n, d in got if n == "content_block_delta") == block["thinking"]
    off = messages(server, max_tokens=20, thinking={"type": "disabled"}).json()
    assert [b["type"] for b in off["content"]] == ["text"]
    bad = messages(server, max_tokens=20, thinking={"type": "enabled", "budget_tokens": 20})
    assert bad.status_code == 400 and "thinking.budget_tokens" in bad.json()["error"]["message"]


def test_llm_chat_reads_reasoning_and_passes_chat_template_kwargs(model_dir):
    from layerzoo import LLM

    llm = LLM(str(model_dir))
    params = SamplingParams(max_tokens=20, temperature=0)
    (thinking,) = llm.chat(ASK, params)
    c = thinking.outputs[0]
    assert thinking.prompt.endswith("<think>\n") and c.reasoning_content == c.text and c.content is None
    (plain,) = llm.chat(ASK, params, chat_template_kwargs={"enable_thinking": False})
    c = plain.outputs[0]
    assert plain.prompt.endswith("</think>\n\n") and c.reasoning_content is None and c.content == c.text
    both = llm.chat([ASK, HISTORY], SamplingParams(max_tokens=200, temperature=0), tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                    chat_template_kwargs={"enable_thinking": False})
    assert [len(out.outputs[0].tool_calls) for out in both] == [1, 1]
