"""Tool calls and reasoning through `layerzoo serve` (issue 31): the official ``openai`` and
``anthropic`` clients and Anthropic's Messages shape, on the embedded random-weight Qwen3 model (Hermes chat format) given
a Qwen3-style thinking template (``enable_thinking`` opens ``<think>`` in the prompt, as Qwen3's
thinking templates do). The model writes no call by itself: ``tool_choice`` ``required`` / named
make its grammar force one; the streamed deltas reassemble to the non-streamed message."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")

from layerzoo.entrypoints.chat import prepare_chat  # noqa: E402
from layerzoo.loading.model_packages import DEFAULT_MODEL  # noqa: E402
from layerzoo.sampling import SamplingParams  # noqa: E402
from layerzoo.server.process import ServerProcess  # noqa: E402
from layerzoo.tokenization.chat_formats import BUILTIN_FORMATS  # noqa: E402
from layerzoo.tokenization.tokenizer import Tokenizer  # noqa: E402

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
    # The same prompt as the OpenAI-shaped tools and history render (tools' keys in OpenAI's order)
    plan = prepare_chat(Tokenizer.from_dir(model_dir), BUILTIN_FORMATS["hermes"], HISTORY, SamplingParams(), tools=TOOLS,
                        chat_template_kwargs={"enable_thinking": False})
    assert reply["usage"]["input_tokens"] == len(Tokenizer.from_dir(model_dir).encode(plan.prompt))


def test_anthropic_thinking_blocks_and_thinking_deltas(server):
    # The budget closes the reasoning after 10 tokens (the random model never does): a thinking
    # block, then the text the model writes after the forced </think>.
    reply = messages(server, max_tokens=30, thinking={"type": "enabled", "budget_tokens": 10}).json()
    thinking, text = reply["content"]
    assert thinking["type"] == "thinking" and thinking["thinking"] and text["type"] == "text" and text["text"]
    got = events(server, max_tokens=30, thinking={"type": "enabled", "budget_tokens": 10})
    assert [d["content_block"]["type"] for n, d in got if n == "content_block_start"] == ["thinking", "text"]
    deltas = [d["delta"] for n, d in got if n == "content_block_delta"]
    assert "".join(d.get("thinking", "") for d in deltas) == thinking["thinking"]
    assert "".join(d.get("text", "") for d in deltas) == text["text"]
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


# The official anthropic client: it has no temperature argument, so greedy decoding goes in extra_body.

GREEDY = {"temperature": 0}
OFF = {"type": "disabled"}


@pytest.fixture(scope="module")
def aclient(server):
    anthropic = pytest.importorskip("anthropic")
    return anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0, timeout=120)


def create(client, **kwargs):
    args = dict(model="layerzoo", max_tokens=200, messages=ASK, extra_body=GREEDY)
    return client.messages.create(**{**args, **kwargs})


def streamed(client, **kwargs):
    args = dict(model="layerzoo", max_tokens=200, messages=ASK, extra_body=GREEDY)
    with client.messages.stream(**{**args, **kwargs}) as stream:
        kinds = [event.type for event in stream]
        return stream.get_final_message(), kinds


def blocks(message) -> list[tuple]:
    """A message's content without the random tool_use ids."""
    out = []
    for b in message.content:
        if b.type == "tool_use":
            assert b.id.startswith("toolu_")
            out.append(("tool_use", b.name, b.input))
        elif b.type == "thinking":
            out.append(("thinking", b.thinking))
        else:
            out.append((b.type, b.text))
    return out


def same_message(a, b) -> None:
    assert blocks(a) == blocks(b)
    assert (a.stop_reason, a.stop_sequence, a.usage.input_tokens, a.usage.output_tokens) == \
        (b.stop_reason, b.stop_sequence, b.usage.input_tokens, b.usage.output_tokens)


def test_tool_choice_any_answers_one_tool_use_and_the_stream_reassembles_to_it(aclient):
    args = dict(tools=ANTHROPIC_TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True}, thinking=OFF)
    reply = create(aclient, **args)
    assert reply.stop_reason == "tool_use" and reply.role == "assistant" and reply.model == "layerzoo"
    (block,) = reply.content
    assert block.type == "tool_use" and fits(block.name, block.input), block
    final, kinds = streamed(aclient, **args)
    same_message(final, reply)
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "input_json" in kinds


def test_parallel_calls_cut_by_max_tokens_keep_their_order_in_both_shapes(aclient):
    # The random model chains calls until max_tokens cuts one: the text after the last whole call
    # is a text block after the tool_use blocks, streamed or not.
    args = dict(tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}, thinking=OFF, max_tokens=100)
    reply = create(aclient, **args)
    kinds = [b[0] for b in blocks(reply)]
    assert reply.stop_reason == "max_tokens" and kinds[0] == "tool_use", blocks(reply)
    assert all(fits(b.name, b.input) for b in reply.content if b.type == "tool_use")
    assert kinds == sorted(kinds, key=lambda k: k != "tool_use")  # text only after the calls
    same_message(streamed(aclient, **args)[0], reply)


def test_anthropic_named_tool_choice_calls_that_tool(aclient):
    reply = create(aclient, tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "get_time"}, thinking=OFF)
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert calls and all(b.name == "get_time" and fits("get_time", b.input) for b in calls)


@pytest.mark.parametrize("choice", ["auto", "none"])
def test_auto_and_none_leave_the_random_text_as_text(aclient, choice):
    args = dict(tools=ANTHROPIC_TOOLS, tool_choice={"type": choice}, thinking=OFF, max_tokens=12)
    reply = create(aclient, **args)
    assert [b.type for b in reply.content] == ["text"] and reply.content[0].text
    assert reply.stop_reason == "max_tokens" and reply.usage.output_tokens == 12
    same_message(streamed(aclient, **args)[0], reply)


def test_a_tool_result_follow_up_renders_the_history(aclient, model_dir):
    first = create(aclient, tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "get_weather",
                                                               "disable_parallel_tool_use": True}, thinking=OFF)
    (use,) = first.content
    history = ASK + [{"role": "assistant", "content": first.content},  # the client's own blocks sent back
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "Sunny, 21 C"}]}]
    reply = create(aclient, messages=history, tools=ANTHROPIC_TOOLS, thinking=OFF, max_tokens=1)
    # The prompt is the OpenAI-shaped history's: the call, then the result as a tool message.
    openai_history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": use.id, "type": "function", "function": {
            "name": use.name, "arguments": use.input}}]},
        {"role": "tool", "tool_call_id": use.id, "content": "Sunny, 21 C"}]
    tokenizer = Tokenizer.from_dir(model_dir)
    plan = prepare_chat(tokenizer, BUILTIN_FORMATS["hermes"], openai_history, SamplingParams(), chat_template_kwargs={
        "enable_thinking": False}, tools=TOOLS)
    assert "<tool_response>\nSunny, 21 C\n</tool_response>" in plan.prompt
    assert reply.usage.input_tokens == len(tokenizer.encode(plan.prompt))
    counted = aclient.messages.count_tokens(model="layerzoo", messages=history, tools=ANTHROPIC_TOOLS, thinking=OFF)
    assert counted.input_tokens == reply.usage.input_tokens


def test_thinking_blocks_streamed_and_sent_back(aclient):
    reply = create(aclient, max_tokens=16, thinking={"type": "adaptive"})
    (block,) = reply.content  # the random model never closes <think>: all of it is thinking
    assert block.type == "thinking" and block.thinking and block.signature == ""
    final, kinds = streamed(aclient, max_tokens=16, thinking={"type": "adaptive"})
    same_message(final, reply)
    assert "thinking" in kinds
    # The client's thinking block goes back in the next turn (the template's reasoning_content).
    history = ASK + [{"role": "assistant", "content": reply.content}, {"role": "user", "content": "And tomorrow?"}]
    again = create(aclient, max_tokens=1, thinking=OFF, messages=history)
    counted = aclient.messages.count_tokens(model="layerzoo", messages=history, thinking=OFF)
    assert again.usage.input_tokens == counted.input_tokens > reply.usage.input_tokens


@pytest.mark.parametrize("budget", [1, 6])
def test_thinking_budget_tokens_close_the_reasoning(aclient, model_dir, budget):
    free = create(aclient, max_tokens=30, thinking={"type": "adaptive"})
    reply = create(aclient, max_tokens=30, thinking={"type": "enabled", "budget_tokens": budget})
    (thinking, text) = reply.content
    assert thinking.type == "thinking" and text.type == "text" and text.text
    # The first `budget` tokens are what the model thinks unbudgeted; then </think> is forced.
    tokenizer = Tokenizer.from_dir(model_dir)
    assert free.content[0].thinking.startswith(thinking.thinking)
    assert len(tokenizer.encode(thinking.thinking, add_special_tokens=False)) == budget
    final, _ = streamed(aclient, max_tokens=30, thinking={"type": "enabled", "budget_tokens": budget})
    same_message(final, reply)


def test_openai_thinking_token_budget(client, model_dir):
    free = chat(client, max_tokens=30, tools=None).choices[0].message
    reply = chat(client, max_tokens=30, tools=None, extra_body={"thinking_token_budget": 4})
    message = reply.choices[0].message
    assert free.reasoning_content.startswith(message.reasoning_content) and message.content
    assert len(Tokenizer.from_dir(model_dir).encode(message.reasoning_content, add_special_tokens=False)) == 4
    streamed, _, _ = reassembled(chat(client, stream=True, max_tokens=30, tools=None, extra_body={"thinking_token_budget": 4}))
    assert (streamed["reasoning"], streamed["content"]) == (message.reasoning_content, message.content)
    bad = client.chat.completions.with_raw_response.create
    with pytest.raises(openai.BadRequestError) as info:
        bad(model="layerzoo", messages=ASK, max_tokens=5, extra_body={"thinking_token_budget": -1})
    assert info.value.body["param"] == "thinking_token_budget"


def test_count_tokens_equals_the_messages_input_tokens(aclient):
    for args in (dict(), dict(tools=ANTHROPIC_TOOLS, tool_choice={"type": "any"}), dict(thinking=OFF, system="Be brief.")):
        counted = aclient.messages.count_tokens(model="layerzoo", messages=ASK, **args)
        reply = create(aclient, max_tokens=1, **args)
        assert counted.input_tokens == reply.usage.input_tokens > 0, args


def test_bad_fields_are_the_clients_bad_request_errors(aclient):
    with pytest.raises(pytest.importorskip('anthropic').BadRequestError) as info:
        create(aclient, max_tokens=16, thinking={"type": "enabled", "budget_tokens": 16})
    assert "thinking.budget_tokens" in str(info.value)
    with pytest.raises(pytest.importorskip('anthropic').BadRequestError) as info:
        create(aclient, tools=ANTHROPIC_TOOLS, tool_choice={"type": "tool", "name": "nope"})
    assert "tool_choice" in str(info.value)
    with pytest.raises(pytest.importorskip('anthropic').BadRequestError) as info:
        create(aclient, max_tokens=16, thinking={"type": "adaptive", "budget_tokens": 8})
    assert "thinking.budget_tokens" in str(info.value)


def test_the_anthropic_clients_models_list_and_retrieve(aclient, client):
    (listed,) = list(aclient.models.list())
    got = aclient.models.retrieve("layerzoo")
    assert (listed.id, listed.type, listed.display_name) == (got.id, got.type, got.display_name) == ("layerzoo", "model", "layerzoo")
    assert listed.created_at == got.created_at and listed.created_at.year >= 2024
    # the openai client still gets OpenAI's shape
    assert client.models.retrieve("layerzoo").owned_by == "layerzoo"


def test_completions_take_thinking_token_budget(client, model_dir):
    # A raw prompt that ends inside <think>: the budget counts from the first generated token.
    prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    text = client.completions.create(model="layerzoo", prompt=prompt, max_tokens=20, temperature=0,
                                     extra_body={"thinking_token_budget": 3}).choices[0].text
    tokenizer = Tokenizer.from_dir(model_dir)
    head, _, _ = text.partition("</think>")
    assert "</think>" in text and len(tokenizer.encode(head, add_special_tokens=False)) == 3, text
