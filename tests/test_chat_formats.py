"""Chat formats (`layerzoo.tokenization.chat_formats`): tool calls and reasoning read back from real format
strings, one-shot and streamed (split at every character, equal to the one-shot parse, no marker
text leaking as content); the plugins' registrations; and the tool-call grammars forcing a call
that parses and fits the schema on the embedded random-weight model (`layerzoo.entrypoints.chat`)."""

from __future__ import annotations

import itertools
import json

import pytest

from layerzoo.errors import UserError
from layerzoo.plugins.manager import get_registry
from layerzoo.tokenization.chat_formats import BUILTIN_FORMATS, ChatFormat, collect

HERMES = ('<think>\nThe user wants weather.\n</think>\n\nLet me check.\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>')
GLM = ('<think>Need the weather.</think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n'
       '<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n<arg_key>opts</arg_key>\n<arg_value>{"units": "C"}</arg_value>\n</tool_call>')
KIMI = ('<think>weather</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0'
        '<|tool_call_argument_begin|>{"city": "Paris", "days": 2}<|tool_call_end|><|tool_call_begin|>functions.get_time:1'
        '<|tool_call_argument_begin|>{"tz": "CET"}<|tool_call_end|><|tool_calls_section_end|>')
LLAMA = '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}'
QWEN3_CODER = ('<think>\nWeather.\n</think>\n\nChecking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n'
               '</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=get_time>\n'
               '<parameter=tz>\nCET\n</parameter>\n</function>\n</tool_call>')

EXPECTED = {
    "hermes": (HERMES, "Let me check.\n", "The user wants weather.\n",
               [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "CET"})]),
    "glm": (GLM, None, "Need the weather.", [("get_weather", {"city": "Paris", "days": 2, "opts": {"units": "C"}})]),
    "kimi": (KIMI, "Checking.", "weather", [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "CET"})]),
    "llama3_json": (LLAMA, None, None, [("get_weather", {"city": "Paris", "days": 2})]),
    "qwen3_coder": (QWEN3_CODER, "Checking.\n", "Weather.\n",
                    [("get_weather", {"city": "Paris", "days": 2}), ("get_time", {"tz": "CET"})]),
}
# Texts that are no (complete) call: kept as content, whole.
NOT_CALLS = {
    "hermes": ["a < b and <tool", "<tool_call>\n{not json}\n</tool_call> after", "x <think>y</think>", "<tool_call>\n{\"name\": \"f\""],
    "glm": ["<tool_call>\n</tool_call>", "<tool_call>f<arg_key>a</arg_key>junk</tool_call>"],
    "kimi": ["<|tool_calls_section_begin|>nothing<|tool_calls_section_end|>", "<|tool_calls_"],
    "llama3_json": ["{not json", "Hello {\"name\": \"f\"}", '{"nam": "f"}'],
    "qwen3_coder": ["<tool_call>\n<function=f>\njunk</function>\n</tool_call>", "a <tool_call>\n<function=f",
                    "<tool_call>\n<parameter=a>\n1\n</parameter>\n</tool_call>"],
}


def counter():
    ids = itertools.count()
    return lambda: f"call_{next(ids)}"


def streamed(fmt: ChatFormat, pieces: list[str], **kwargs):
    parser = fmt.stream(make_id=counter(), **kwargs)
    events = [e for piece in pieces for e in parser.feed(piece)] + parser.finish()
    return events


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_format_parses_its_calls_and_reasoning(name):
    text, content, reasoning, calls = EXPECTED[name]
    parsed = BUILTIN_FORMATS[name].parse(text, make_id=counter())
    assert parsed.content == content
    assert parsed.reasoning_content == reasoning
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == calls
    if name == "kimi":  # Kimi's ids are the text's own
        assert [c.id for c in parsed.tool_calls] == ["functions.get_weather:0", "functions.get_time:1"]


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_streaming_split_anywhere_equals_the_one_shot_parse(name):
    fmt = BUILTIN_FORMATS[name]
    for text in [EXPECTED[name][0], *NOT_CALLS[name]]:
        one = fmt.parse(text, make_id=counter())
        for cut in range(len(text) + 1):
            assert collect(streamed(fmt, [text[:cut], text[cut:]])) == one, (text, cut)
        events = streamed(fmt, list(text))  # a character at a time
        assert collect(events) == one
        if one.tool_calls:  # no piece of a marker ever went out as content
            marker = (fmt.block or ("<|python_tag|>",))[0]
            assert not any(e.kind == "content" and marker[:2] in e.text for e in events), events


@pytest.mark.parametrize("name", sorted(NOT_CALLS))
def test_text_that_is_no_call_stays_content(name):
    for text in NOT_CALLS[name]:
        parsed = BUILTIN_FORMATS[name].parse(text)
        assert parsed.tool_calls == [] and parsed.content == text, text


def test_stream_deltas_are_openai_shaped():
    events = streamed(BUILTIN_FORMATS["hermes"], list(HERMES))
    deltas = [d for e in events for d in e.openai_deltas()]
    calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
    # first delta of a call: index, id, type, name and empty arguments; then the arguments
    assert calls[0] == {"index": 0, "id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": ""}}
    assert calls[1] == {"index": 0, "function": {"arguments": '{"city": "Paris", "days": 2}'}}
    assert calls[2]["index"] == 1 and calls[2]["function"]["name"] == "get_time"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == "The user wants weather.\n"
    assert "".join(d.get("content", "") for d in deltas) == "Let me check.\n"


def test_reasoning_opened_by_the_template():
    fmt = BUILTIN_FORMATS["hermes"]
    # Qwen3's thinking templates end the prompt inside <think>; enable_thinking=False closes it.
    assert fmt.reasoning_open("<|im_start|>assistant\n<think>\n")
    assert not fmt.reasoning_open("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not fmt.reasoning_open("<|im_start|>assistant\n")
    text = "Thinking it over.</think>\n\nThe answer."
    parsed = fmt.parse(text, reasoning_open=True)
    assert (parsed.reasoning_content, parsed.content) == ("Thinking it over.", "The answer.")
    for cut in range(len(text) + 1):
        assert collect(streamed(fmt, [text[:cut], text[cut:]], reasoning_open=True)) == parsed
    # Not opened by the prompt and not opened by the output: all content.
    assert fmt.parse(text).content == text


def test_tools_off_leaves_calls_as_content():
    parsed = BUILTIN_FORMATS["hermes"].parse(HERMES, tools=False)
    assert parsed.tool_calls == [] and parsed.reasoning_content == "The user wants weather.\n"
    assert parsed.content.startswith("Let me check.\n<tool_call>")


def test_plugins_register_their_architectures_formats():
    registry = get_registry()
    expected = {"Qwen3ForCausalLM": "hermes", "Qwen3MoeForCausalLM": "hermes", "Qwen2ForCausalLM": "hermes",
                "Qwen3NextForCausalLM": "hermes", "Qwen3_5ForCausalLM": "qwen3_coder", "Qwen3_5MoeForCausalLM": "qwen3_coder",
                "Qwen3_5ForConditionalGeneration": "qwen3_coder", "Qwen3_5MoeForConditionalGeneration": "qwen3_coder",
                "GlmMoeDsaForCausalLM": "glm",
                "KimiK3ForConditionalGeneration": "kimi", "KimiLinearForCausalLM": "kimi", "LlamaForCausalLM": "llama3_json"}
    for architecture, name in expected.items():
        if registry.architectures.get(architecture) is None:
            continue  # that plugin is not installed here
        assert registry.chat_format(architecture).name == name, architecture
    assert registry.chat_format("NoSuchArchitecture") is None


def test_qwen3_coder_values_are_typed_by_the_tools_schema():
    fmt = BUILTIN_FORMATS["qwen3_coder"]
    text = ('<tool_call>\n<function=send>\n<parameter=zip>\n75001\n</parameter>\n<parameter=body>\nline 1\nline 2\n'
            '</parameter>\n<parameter=opts>\n{"cc": ["a"]}\n</parameter>\n<parameter=n>\n2.5\n</parameter>\n'
            '<parameter=raw>\nnot json\n</parameter>\n</function>\n</tool_call>')
    schemas = {"send": {"type": "object", "properties": {"zip": {"type": "string"}, "body": {"type": "string"},
                                                          "opts": {"type": "object"}, "n": {"type": "number"},
                                                          "raw": {"type": "integer"}}}}
    (typed,) = fmt.parse(text, schemas=schemas).tool_calls
    assert json.loads(typed.arguments) == {"zip": "75001", "body": "line 1\nline 2", "opts": {"cc": ["a"]}, "n": 2.5,
                                           "raw": "not json"}  # a value that is no JSON stays text, as vLLM degrades
    (untyped,) = fmt.parse(text).tool_calls  # no schema: JSON where it parses
    assert json.loads(untyped.arguments)["zip"] == 75001
    for cut in range(len(text) + 1):
        assert collect(streamed(fmt, [text[:cut], text[cut:]], schemas=schemas)).tool_calls[0].arguments == typed.arguments
    with pytest.raises(UserError, match="format"):
        fmt.tool_call_grammar([{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"when": {"type": "string", "format": "date-time"}}}}}])


# -- grammars: tool_choice "required" / named on a random-weight model ----------------------------

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather of a city", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                         "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "get_time", "parameters": {
        "type": "object", "properties": {"tz": {"enum": ["UTC", "CET", "JST"]}}, "required": ["tz"]}}},
]


def fits(name: str, args: dict) -> bool:
    if name == "get_weather":
        return (set(args) == {"city", "days"} and isinstance(args["city"], str) and len(args["city"]) <= 12
                and type(args["days"]) is int and 1 <= args["days"] <= 7)
    return name == "get_time" and args == {"tz": args.get("tz")} and args["tz"] in ("UTC", "CET", "JST")


@pytest.fixture(scope="module")
def llm():
    pytest.importorskip("torch")
    from layerzoo import LLM

    return LLM(None)


@pytest.mark.parametrize("name", sorted(BUILTIN_FORMATS))
def test_required_and_named_tool_choice_force_a_parseable_schema_valid_call(llm, name):
    from layerzoo.entrypoints.chat import prepare_chat
    from layerzoo.sampling import SamplingParams

    fmt = BUILTIN_FORMATS[name]
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    unconstrained = prepare_chat(llm.tokenizer, fmt, messages, SamplingParams(max_tokens=40, temperature=0), tools=TOOLS)
    plain = llm.generate({"prompt": unconstrained.prompt}, unconstrained.params)[0].outputs[0].text
    assert unconstrained.parse(plain).tool_calls == []  # the model writes no call by itself
    choices = ["required", {"type": "function", "function": {"name": "get_time"}}]
    for choice, seed, parallel in itertools.product(choices, (1, 2), (True, False)):
        plan = prepare_chat(llm.tokenizer, fmt, messages, SamplingParams(max_tokens=600, temperature=1.0, seed=seed),
                            tools=TOOLS, tool_choice=choice, parallel_tool_calls=parallel)
        out = llm.generate({"prompt": plan.prompt}, plan.params)[0].outputs[0]
        parsed = plan.parse(out.text)
        assert out.finish_reason == "stop", out.text  # (parallel: at most MAX_PARALLEL_CALLS calls)
        assert parsed.tool_calls and parsed.content is None, out.text
        assert parallel or len(parsed.tool_calls) == 1
        for call in parsed.tool_calls:
            assert fits(call.name, json.loads(call.arguments)), out.text
            assert choice == "required" or call.name == "get_time"


def test_tool_choice_errors_name_the_field(llm):
    from layerzoo.entrypoints.chat import prepare_chat
    from layerzoo.sampling import SamplingParams

    fmt, messages, params = BUILTIN_FORMATS["hermes"], [{"role": "user", "content": "hi"}], SamplingParams()
    cases = [
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice.function.name"),
        (dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
        (dict(tools=[{"type": "function"}]), "tools.0"),
        (dict(tools=TOOLS, chat_template_kwargs={"tools": []}), "chat_template_kwargs.tools"),
    ]
    for kwargs, field in cases:
        with pytest.raises(UserError, match=rf"^{field}:"):
            prepare_chat(llm.tokenizer, fmt, messages, params, **kwargs)
    with pytest.raises(UserError, match="^tools: this model's architecture registers no chat format"):
        prepare_chat(llm.tokenizer, None, messages, params, tools=TOOLS)
    bad = [{"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{oops"}}]}]
    with pytest.raises(UserError, match=r"^messages.0.tool_calls.0.function.arguments:"):
        prepare_chat(llm.tokenizer, fmt, bad, params)


KIMI_MARKERS = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
                "<|tool_call_argument_begin|>", "<|tool_call_end|>"]


@pytest.fixture(scope="module")
def kimi_tokens_llm(tmp_path_factory):
    """The embedded model whose last five tokens are Kimi's tool-call markers, as special tokens."""
    pytest.importorskip("torch")
    from layerzoo import LLM
    from layerzoo.loading.model_packages import DEFAULT_MODEL

    path = tmp_path_factory.mktemp("kimi-tokens")
    for f in DEFAULT_MODEL.iterdir():
        if f.name != "tokenizer.json":
            (path / f.name).symlink_to(f)
    tj = json.loads((DEFAULT_MODEL / "tokenizer.json").read_text())
    vocab = tj["model"]["vocab"]
    by_id = {i: word for word, i in vocab.items()}
    ids = range(len(vocab) - len(KIMI_MARKERS), len(vocab))
    replaced = {by_id[i] for i in ids}
    for i, marker in zip(ids, KIMI_MARKERS):
        del vocab[by_id[i]]
        vocab[marker] = i
        tj["added_tokens"].append({"id": i, "content": marker, "single_word": False, "lstrip": False, "rstrip": False,
                                   "normalized": False, "special": True})
    # (no merge may make or use a token that is gone)
    tj["model"]["merges"] = [m for m in tj["model"]["merges"]
                             if "".join(m) not in replaced and not any(part in replaced for part in m)]
    (path / "tokenizer.json").write_text(json.dumps(tj))
    return LLM(str(path)), list(ids)


def test_kimi_markers_that_are_special_tokens_are_generated_and_read_as_tokens(kimi_tokens_llm):
    from layerzoo.entrypoints.chat import prepare_chat
    from layerzoo.sampling import SamplingParams

    llm, marker_ids = kimi_tokens_llm
    plan = prepare_chat(llm.tokenizer, BUILTIN_FORMATS["kimi"], [{"role": "user", "content": "Time?"}],
                        SamplingParams(max_tokens=100, temperature=1.0, seed=1), tools=TOOLS, tool_choice="required",
                        parallel_tool_calls=False)
    assert plan.params.skip_special_tokens is False  # else the markers would vanish from the text
    assert "start: <|tool_calls_section_begin|> call " in plan.params.structured_outputs.grammar  # token references
    out = llm.generate({"prompt": plan.prompt}, plan.params)[0].outputs[0]
    assert out.token_ids[0] == marker_ids[0] and out.finish_reason == "stop"  # the marker as its one token
    (call,) = plan.parse(out.text).tool_calls
    assert fits(call.name, json.loads(call.arguments)) and call.id.startswith(f"functions.{call.name}:")
