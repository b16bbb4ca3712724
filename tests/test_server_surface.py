"""The rest of the OpenAI/Anthropic surface of `layerzoo serve`, with the real clients where they
have the call: ``logit_bias``, ``n`` with ``best_of``, unknown request fields refused by name,
``GET /v1/models/{id}`` and ``POST /v1/messages/count_tokens``.
"""

import json

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")


MODEL = "layerzoo"


def greedy_ids(offline, prompt, max_tokens, **kw):
    from layerzoo.sampling import SamplingParams

    out = offline.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **kw), use_tqdm=False)[0]
    return out.outputs[0]


# -- logit_bias ----------------------------------------------------------------------------------------


def test_logit_bias_forces_and_bans(client, offline):
    prompt, token = "import os\n", 77
    for temperature in (0, 1.0):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=temperature, seed=2,
                                      logit_bias={str(token): 100}, logprobs=0, extra_body={"ignore_eos": True})
        tokens = r.choices[0].logprobs.tokens
        assert tokens == [offline.tokenizer.decode([token], skip_special_tokens=False)] * 3
    plain = greedy_ids(offline, prompt, 3)
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, temperature=0,
                                  logit_bias={str(plain.token_ids[0]): -100})
    assert r.choices[0].text == greedy_ids(offline, prompt, 3, logit_bias={plain.token_ids[0]: -100}).text
    assert r.choices[0].text != plain.text
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                          temperature=0, logit_bias={str(token): 100}, logprobs=True)
    assert [c.token for c in chat.choices[0].logprobs.content] == [offline.tokenizer.decode([token])] * 2


def test_logit_bias_refusals(client, offline):
    vocab = offline.engine.loaded.config.vocab_size
    for bias, message in (({"x": 1}, "token ids as strings"), ({"1": 101}, "[-100, 100]"),
                          ({str(vocab): 1}, "outside the vocabulary"), ({"1": "high"}, "valid number")):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1, logit_bias=bias)
        assert exc.value.body["param"].startswith("logit_bias") and message in exc.value.body["message"], exc.value.body


# -- n with best_of ------------------------------------------------------------------------------------


def test_best_of_returns_the_n_most_likely_of_best_of_samples(client):
    kw = dict(model=MODEL, prompt="def parse(line):\n", max_tokens=6, temperature=1.0, seed=11)
    every = client.completions.create(n=4, logprobs=0, **kw).choices
    assert len({c.text for c in every}) > 1  # the samples differ: the choice is a real one
    ranked = sorted(every, key=lambda c: -sum(c.logprobs.token_logprobs))
    best = client.completions.create(n=2, best_of=4, **kw)
    assert [c.index for c in best.choices] == [0, 1]
    assert [c.text for c in best.choices] == [c.text for c in ranked[:2]]
    assert all(c.logprobs is None for c in best.choices)  # ranked with logprobs, not asked for
    assert best.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in every)  # all four ran
    with_logprobs = client.completions.create(n=1, best_of=4, logprobs=1, **kw).choices
    assert with_logprobs[0].text == ranked[0].text and len(with_logprobs[0].logprobs.top_logprobs[0]) == 1
    assert client.completions.create(n=2, best_of=2, **kw).choices[1].index == 1


def test_best_of_refusals(client):
    for kw, message in ((dict(n=3, best_of=2), "from n (3)"), (dict(best_of=17), "to 16"),
                        (dict(best_of=3, stream=True), "streamed")):
        with pytest.raises(openai.BadRequestError) as exc:
            client.completions.create(model=MODEL, prompt="x", max_tokens=1, **kw)
        assert exc.value.body["param"] == "best_of" and message in exc.value.body["message"], exc.value.body
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=["a"] * 5, max_tokens=1, best_of=16)
    assert exc.value.body["param"] == "best_of" and "limit of 64" in exc.value.body["message"]


# -- GET /v1/models/{id}, POST /v1/messages/count_tokens -------------------------------------------


def test_models_retrieve(server, client):
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.owned_by == "layerzoo"
    assert model.model_dump() == client.models.list().data[0].model_dump()
    for unknown in ("gpt-9", "org/other-model"):
        with pytest.raises(openai.NotFoundError) as exc:
            client.models.retrieve(unknown)
        assert exc.value.body["code"] == "model_not_found" and unknown in exc.value.body["message"]


WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def test_count_tokens_equals_the_messages_prompt(server):
    headers = {"anthropic-version": "2023-06-01"}
    conversation = {"system": [{"type": "text", "text": "You write Python."}],
                    "messages": [{"role": "user", "content": "def"}, {"role": "assistant", "content": "main():"},
                                 {"role": "user", "content": [{"type": "text", "text": "and then?"}]}]}
    counts = []
    for extra in ({}, {"tools": [WEATHER]}):
        body = {"model": MODEL, **conversation, **extra}
        r = httpx.post(f"{server.url}/v1/messages/count_tokens", json=body, headers=headers)
        assert r.status_code == 200 and set(r.json()) == {"input_tokens"}
        sent = httpx.post(f"{server.url}/v1/messages", json={**body, "max_tokens": 1}, headers=headers, timeout=60).json()
        assert r.json()["input_tokens"] == sent["usage"]["input_tokens"]
        counts.append(r.json()["input_tokens"])
    assert counts[1] > counts[0]  # the tools are in the rendered prompt


def test_count_tokens_refusals(server):
    url = f"{server.url}/v1/messages/count_tokens"
    messages = [{"role": "user", "content": "hi"}]
    r = httpx.post(url, json={"model": MODEL, "messages": messages, "temperature": 0.5})
    assert r.status_code == 400 and r.json()["type"] == "error" and "temperature" in r.json()["error"]["message"]
    r = httpx.post(url, json={"model": "other", "messages": messages})
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = httpx.post(url, json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and "messages" in r.json()["error"]["message"]


# -- unknown fields are refused by name ----------------------------------------------------------------


def test_unknown_fields_are_refused_by_name(server, client):
    cases = [
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "frobnicate": True}, "frobnicate"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1, "functions": []},
         "functions"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x", "weight": 2}], "max_tokens": 1},
         "messages.0.weight"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "text", "text": "x", "lang": "en"}]}],
                                  "max_tokens": 1}, "messages.0.content.0.lang"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
                                  "stream": True, "stream_options": {"include_usage": True, "every": 2}},
         "stream_options.every"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 1, "response_format": {
            "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}, "extra": 1}}},
         "response_format.json_schema.extra"),
    ]
    for path, body, field in cases:
        r = httpx.post(f"{server.url}{path}", json={"model": MODEL, **body})
        assert r.status_code == 400, (field, r.text)
        error = r.json()["error"]
        assert error["param"] == field and error["message"].startswith(f"{field}: unrecognized request argument"), error
    r = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "max_tokens": 1, "top_logprobs": 2,
                                                      "messages": [{"role": "user", "content": "x"}]})
    assert r.status_code == 400 and r.json()["type"] == "error"
    assert r.json()["error"]["message"].startswith("top_logprobs: unrecognized request argument")


def test_fields_without_generation_meaning_are_accepted(server, client, offline):
    want = greedy_ids(offline, "import os\n", 3).text
    meaningless = {"metadata": {"team": "a"}, "store": False, "service_tier": "auto", "safety_identifier": "s",
                   "prompt_cache_key": "k"}
    r = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=3, temperature=0, user="u",
                                  extra_body=meaningless)
    assert r.choices[0].text == want
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                          user="u", metadata={"a": "b"}, store=False, service_tier="auto")
    assert chat.choices[0].finish_reason in ("stop", "length")
    body = {"model": MODEL, "max_tokens": 1, "metadata": {"user_id": "u"}, "service_tier": "auto",
            "system": [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}]}]}
    r = httpx.post(f"{server.url}/v1/messages", json=body, timeout=60)
    assert r.status_code == 200, r.text


def test_the_openai_client_sends_only_what_it_is_given(server):
    sent = []
    http = httpx.Client(event_hooks={"request": [lambda request: sent.append(json.loads(request.read()))]})
    api = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, http_client=http)
    api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1)
    api.completions.create(model=MODEL, prompt="x", max_tokens=1)
    list(api.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=1,
                                     stream=True))
    assert [set(body) for body in sent] == [{"model", "messages", "max_tokens"}, {"model", "prompt", "max_tokens"},
                                            {"model", "messages", "max_tokens", "stream"}]


def test_openapi_lists_the_new_routes_and_fields(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    assert {"/v1/models/{model_id}", "/v1/messages/count_tokens"} <= set(schema["paths"])
    bodies = schema["components"]["schemas"]
    assert {"echo", "best_of", "logit_bias", "user", "store"} <= set(bodies["CompletionRequest"]["properties"])
    assert bodies["CompletionRequest"]["additionalProperties"] is False
    assert "CountTokensRequest" in bodies
