"""`layerzoo serve` on the embedded model, driven by the real `openai` client and raw HTTP.

One server process (the real CLI, on 127.0.0.1 and a free port, with an API key) serves the
module; the last test drains it with SIGTERM. Leaks are read from the server's own `/metrics`
(KV blocks, decode slots and requests the engine still holds).
"""

import json
import signal
import socket
import threading
import time

import pytest

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from layerzoo.server.process import ServerProcess  # noqa: E402

KEY = "test-key"
MODEL = "layerzoo"


@pytest.fixture(scope="module")
def server():
    # a long drain timeout: the last test's 2000-token stream must end by itself even on a busy
    # machine (~80 tok/s on two loaded cores)
    with ServerProcess("--api-key", KEY, "--max-body-bytes", "65536", "--drain-timeout", "300") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline():
    """The same embedded model, offline: the reference for greedy outputs."""
    import torch

    from layerzoo.llm import LLM

    torch.set_num_threads(1)
    return LLM()


def metrics(server) -> dict[str, float]:
    return server.metrics()


def wait_idle(server, timeout: float = 30) -> dict[str, float]:
    """Wait until the engine holds no request, block or slot; fail if it never does."""
    deadline = time.monotonic() + timeout
    while True:
        m = metrics(server)
        if (m["layerzoo:num_requests_held"], m["layerzoo:kv_cache_blocks_in_use"], m["layerzoo:decode_slots_in_use"]) == (0, 0, 0):
            return m
        assert time.monotonic() < deadline, f"engine still busy: {m}"
        time.sleep(0.2)


def sse_events(lines) -> list[str]:
    """The ``data:`` payloads of a raw SSE stream, checking the framing."""
    out = []
    for line in lines:
        if not line:
            continue
        assert line.startswith("data: "), line
        out.append(line[len("data: "):])
    return out


def chat_prompt(offline, text: str) -> str:
    return offline.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)


def greedy(offline, prompt: str, max_tokens: int, **kw) -> str:
    from layerzoo.sampling import SamplingParams

    return offline.generate(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, **kw))[0].outputs[0].text


# -- the OpenAI API ----------------------------------------------------------------------------------


def test_models_lists_the_served_model(client):
    (model,) = client.models.list().data
    assert model.id == MODEL


def test_chat_completion_equals_offline_greedy(client, offline):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "def main():"}],
                                       temperature=0, max_tokens=16)
    assert r.choices[0].message.content == greedy(offline, chat_prompt(offline, "def main():"), 16)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens <= 16 and r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_stream_with_usage(client, offline):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "import sys"}],
                                            temperature=0, max_completion_tokens=12, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy(offline, chat_prompt(offline, "import sys"), 12)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert all(c.usage is None for c in chunks[:-1])


def test_completions_stream_raw_sse_ends_with_done(server, offline):
    body = {"model": MODEL, "prompt": "import os\n", "max_tokens": 10, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse_events(r.iter_lines())
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == greedy(offline, "import os\n", 10)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_n_seed_stop_and_penalties(client, offline):
    kw = dict(model=MODEL, prompt="class A:\n", max_tokens=12, temperature=0.9, seed=7, n=3,
              presence_penalty=0.5, frequency_penalty=0.5)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in a.choices] == [c.text for c in b.choices]  # seeded: reproducible
    full = greedy(offline, "import os\n", 20)
    stop = full[4:7]
    r = client.completions.create(model=MODEL, prompt="import os\n", max_tokens=20, temperature=0, stop=[stop])
    assert r.choices[0].finish_reason == "stop" and r.choices[0].text == full[: full.index(stop)]


def test_chat_n_streams_every_choice(client):
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "for"}], n=3, seed=5,
                                            temperature=1.0, max_tokens=8, stream=True)
    texts, finished = {0: "", 1: "", 2: ""}, set()
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1, 2} and all(texts.values())
    plain = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "for"}], n=3, seed=5,
                                           temperature=1.0, max_tokens=8)
    assert [c.message.content for c in sorted(plain.choices, key=lambda c: c.index)] == [texts[i] for i in range(3)]


def test_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x = 1"}], temperature=0,
                                       max_tokens=5, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert len(item.top_logprobs) == 3 and item.logprob <= 0
        assert item.top_logprobs[0].logprob >= item.top_logprobs[-1].logprob
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)  # greedy picks the most likely
    c = client.completions.create(model=MODEL, prompt="x = 1", max_tokens=4, temperature=0, logprobs=2)
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4


def test_errors_are_openai_shaped(server, client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert exc.value.body["param"] == "temperature" and "temperature" in exc.value.body["message"]
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="hi", n=99)
    assert exc.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt="hi " * 3000, max_tokens=4)
    assert "context length" in exc.value.body["message"]
    with pytest.raises(openai.NotFoundError) as exc:
        client.completions.create(model="gpt-9", prompt="hi")
    assert exc.value.body["code"] == "model_not_found"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="wrong", max_retries=0).models.list()
    r = httpx.post(f"{server.url}/v1/completions", content=b"{" + b" " * 70000 + b"}",
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.get(f"{server.url}/v1/nothing", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": []}, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    for response in (r,):
        assert "Traceback" not in response.text


def test_a_refused_prompt_in_a_batch_leaves_nothing_running(server, client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL, prompt=[[1, 2, 3], [10**9]], max_tokens=200)
    assert "token ids" in exc.value.body["message"]
    wait_idle(server, timeout=5)  # the first prompt, already queued, was aborted


# -- the Anthropic API -------------------------------------------------------------------------------


def test_anthropic_messages(server, offline):
    headers = {"x-api-key": KEY, "anthropic-version": "2023-06-01"}
    body = {"model": MODEL, "max_tokens": 10, "temperature": 0, "system": "You write Python.",
            "messages": [{"role": "user", "content": [{"type": "text", "text": "def"}]}]}
    r = httpx.post(f"{server.url}/v1/messages", json=body, headers=headers, timeout=60).json()
    prompt = offline.tokenizer.apply_chat_template(
        [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "def"}], add_generation_prompt=True
    )
    assert r["type"] == "message" and r["content"][0]["text"] == greedy(offline, prompt, 10)
    assert r["stop_reason"] in ("end_turn", "max_tokens") and r["usage"]["output_tokens"] <= 10

    with httpx.stream("POST", f"{server.url}/v1/messages", json={**body, "stream": True}, headers=headers) as s:
        raw = s.read().decode()
    names, text = [], ""
    for block in raw.strip().split("\n\n"):
        event, data = block.split("\n")
        name, payload = event.removeprefix("event: "), json.loads(data.removeprefix("data: "))
        assert payload["type"] == name
        names.append(name)
        if name == "content_block_delta":
            text += payload["delta"]["text"]
    assert names[:3] == ["message_start", "content_block_start", "ping"]
    assert names[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert text == r["content"][0]["text"]

    bad = httpx.post(f"{server.url}/v1/messages", json={"messages": [{"role": "user", "content": "x"}]}, headers=headers)
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert "max_tokens" in bad.json()["error"]["message"]


# -- health, metrics, disconnects --------------------------------------------------------------------


def test_health_and_metrics(server, client):
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    client.completions.create(model=MODEL, prompt="import re\n", max_tokens=3)
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("num_requests_running", "num_requests_waiting", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket", "kv_cache_usage_perc",
                 "prefix_cache_hit_rate", "num_preemptions_total", "spec_decode_acceptance_rate"):
        assert f"layerzoo:{name}" in text


def test_a_disconnected_stream_is_aborted(server):
    before = wait_idle(server)
    body = {"model": MODEL, "prompt": "import os\n", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers={"x-api-key": KEY}) as r:
        lines = r.iter_lines()
        next(lines)  # the first chunk arrived: the request is running
        assert metrics(server)["layerzoo:num_requests_held"] == 1
    after = wait_idle(server)  # the engine freed everything: nothing kept generating
    generated = after["layerzoo:generation_tokens_total"] - before["layerzoo:generation_tokens_total"]
    assert generated < 1500


def test_a_disconnected_plain_request_is_aborted(server):
    before = wait_idle(server)
    body = json.dumps({"model": MODEL, "prompt": "import os\n", "max_tokens": 1500, "ignore_eos": True}).encode()
    with socket.create_connection(("127.0.0.1", server.port)) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     + f"x-api-key: {KEY}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        deadline = time.monotonic() + 30
        while metrics(server)["layerzoo:generation_tokens_total"] == before["layerzoo:generation_tokens_total"]:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    after = wait_idle(server)
    assert after["layerzoo:generation_tokens_total"] - before["layerzoo:generation_tokens_total"] < 1500


def test_concurrent_streams_with_a_third_disconnecting_lose_and_leak_nothing(server, offline):
    import asyncio

    prompts = [f"def f{i}(x):\n    " for i in range(6)]
    expected = {p: greedy(offline, p, 12) for p in prompts}

    async def one(api, i):
        stream = await api.completions.create(model=MODEL, prompt=prompts[i % 6], max_tokens=12, temperature=0,
                                              stream=True)
        text = ""
        async with stream:
            async for chunk in stream:
                text += chunk.choices[0].text
                if i % 3 == 2 and len(text) > 0:
                    return None  # leaves mid-stream: the server must abort the request
        return prompts[i % 6], text

    async def main():
        api = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=120)
        try:
            return await asyncio.gather(*(one(api, i) for i in range(12)))
        finally:
            await api.close()

    results = asyncio.run(asyncio.wait_for(main(), 300))
    completed = [r for r in results if r is not None]
    assert len(completed) == 8
    assert all(text == expected[prompt] for prompt, text in completed)
    wait_idle(server)


# -- last: SIGTERM drains ----------------------------------------------------------------------------


def test_sigterm_drains_in_flight_and_refuses_new(server):
    # Long enough to be still in flight when the refused request arrives: the embedded model decodes
    # a single stream at ~2000-3000 tok/s here, so 120 tokens could end within the 0.3 s below.
    body = {"model": MODEL, "prompt": "import os\n", "max_tokens": 2000, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events, first = [], threading.Event()

    def stream():
        with httpx.stream("POST", f"{server.url}/v1/completions", json=body, headers={"x-api-key": KEY}, timeout=120) as r:
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    first.set()

    reader = threading.Thread(target=stream)
    reader.start()
    assert first.wait(60)
    server.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    refused = httpx.post(f"{server.url}/v1/completions", json={"model": MODEL, "prompt": "x"}, headers={"x-api-key": KEY})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert httpx.get(f"{server.url}/health").status_code == 503
    reader.join(120)
    assert events[-1] == "data: [DONE]"
    finish = json.loads(events[-2].removeprefix("data: "))["choices"][0]["finish_reason"]
    assert finish == "length"  # it ran to its end, not aborted
    assert server.proc.wait(60) == 0
