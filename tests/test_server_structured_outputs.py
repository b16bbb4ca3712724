"""Structured outputs through `layerzoo serve` with the official `openai` client: ``response_format``
(``json_object``, ``json_schema`` with ``strict``) and vLLM's ``structured_outputs`` field, on the
embedded random-ish model, which writes no JSON unconstrained."""

from __future__ import annotations

import json

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")


SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 10},
        "population": {"type": "integer", "minimum": 0, "maximum": 100000},
        "capital": {"type": "boolean"},
    },
    "required": ["city", "population", "capital"],
    "additionalProperties": False,
}


def schema_valid(value) -> bool:
    return (
        isinstance(value, dict) and set(value) == {"city", "population", "capital"}
        and isinstance(value["city"], str) and len(value["city"]) <= 10
        and type(value["population"]) is int and 0 <= value["population"] <= 100000
        and isinstance(value["capital"], bool)
    )


MESSAGES = [{"role": "user", "content": "Describe a city as JSON."}]


@pytest.mark.parametrize("strict", [True, False])
def test_chat_json_schema_returns_schema_valid_json(client, strict):
    for temperature in (0, 1.0):
        reply = client.chat.completions.create(
            model="layerzoo", messages=MESSAGES, max_tokens=200, temperature=temperature, seed=1,
            response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA, "strict": strict}},
        )
        content = reply.choices[0].message.content
        assert reply.choices[0].finish_reason == "stop", content
        assert schema_valid(json.loads(content)), content


def test_without_response_format_the_model_writes_no_json(client):
    reply = client.chat.completions.create(model="layerzoo", messages=MESSAGES, max_tokens=40, temperature=0)
    with pytest.raises(ValueError):
        json.loads(reply.choices[0].message.content)


def test_chat_json_object(client):
    reply = client.chat.completions.create(
        model="layerzoo", messages=MESSAGES, max_tokens=300, temperature=0, response_format={"type": "json_object"},
    )
    content = reply.choices[0].message.content
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert content.lstrip().startswith("{")


def test_completions_structured_outputs_field(client):
    reply = client.completions.create(
        model="layerzoo", prompt="The colour is", max_tokens=10, temperature=0,
        extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}},
    )
    assert reply.choices[0].text in ("red", "green", "blue")
    reply = client.completions.create(
        model="layerzoo", prompt="Code:", max_tokens=20, temperature=0,
        extra_body={"structured_outputs": {"regex": "[A-Z]{3}-[0-9]{3}"}},
    )
    assert len(reply.choices[0].text) == 7 and reply.choices[0].text[3] == "-"


def test_streamed_json_schema_reassembles_to_valid_json(client):
    stream = client.chat.completions.create(
        model="layerzoo", messages=MESSAGES, max_tokens=200, temperature=0, stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert schema_valid(json.loads(text)), text


@pytest.mark.parametrize(
    "body, param, message",
    [
        ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs.regex", "invalid regex"),
        ({"structured_outputs": {"jsn": {}}}, "structured_outputs", "jsn"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one of"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
         "response_format.json_schema.schema", "invalid JSON schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format.json_schema.schema", "expected a JSON schema"),
        ({"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}}, "response_format", "one of"),
    ],
)
def test_bad_constraints_are_a_400_naming_the_field(server, body, param, message):
    reply = httpx.post(f"{server.url}/v1/chat/completions", json={"model": "layerzoo", "messages": MESSAGES, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"], error
