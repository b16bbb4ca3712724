"""`layerzoo serve` against a hostile or careless client: bodies no prompt can hold, wrong JSON
types, empty prompts, clients that drop or stall mid-upload or never read, huge prompts, and a
SIGTERM drain that must end whatever the clients do (issue 34).

One server (the real CLI on the embedded model, bodies up to 8 MiB) serves the module; the drain
test starts its own, as it ends it.
"""

import json
import signal
import socket
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from layerzoo.server.process import ServerProcess  # noqa: E402

ENDPOINTS = {
    "completions": ("/v1/completions", lambda text: {"prompt": text, "max_tokens": 2}, "prompt"),
    "chat": ("/v1/chat/completions", lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 2},
             "messages.0.content"),
    "anthropic": ("/v1/messages", lambda text: {"messages": [{"role": "user", "content": text}], "max_tokens": 2},
                  "messages.0.content"),
}


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-body-bytes", str(8 << 20)) as s:
        yield s


def post(server, path: str, body, timeout: float = 60) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()  # ensure_ascii: "\ud800" stays an escape
    return httpx.post(server.url + path, content=content, headers={"Content-Type": "application/json"}, timeout=timeout)


def error_message(response: httpx.Response) -> str:
    body = response.json()
    return body["error"]["message"]


def assert_no_traceback(server) -> None:
    out = server.output()
    assert "Traceback" not in out and "internal error" not in out, out[-3000:]


# -- bodies no prompt can hold ----------------------------------------------------------------------


@pytest.mark.parametrize("endpoint", sorted(ENDPOINTS))
def test_a_lone_surrogate_is_a_400_naming_the_field(server, endpoint):
    path, body, field = ENDPOINTS[endpoint]
    r = post(server, path, body("a\ud800b"))
    assert r.status_code == 400, r.text
    message = error_message(r)
    assert message.startswith(f"{field}: ") and "lone surrogate '\\ud800' at character 1" in message
    if endpoint != "anthropic":
        assert r.json()["error"]["param"] == field
    else:
        assert r.json()["error"]["type"] == "invalid_request_error"


def test_deeply_nested_json_is_a_400(server):
    deep = b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"  # past Python's recursion limit
    r = post(server, "/v1/completions", deep)
    assert r.status_code == 400 and "nested too deeply" in error_message(r)
    nested = {"prompt": "x", "metadata": json.loads("[" * 200 + "]" * 200)}  # parses, but no body is like it
    r = post(server, "/v1/completions", nested)
    assert r.status_code == 400 and "nested deeper than 64 levels" in error_message(r)
    assert_no_traceback(server)


# -- JSON types taken as they are -------------------------------------------------------------------


@pytest.mark.parametrize(
    "path, body, field",
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": True}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": "10"}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "max_tokens": 2.0}, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "stream": "yes"}, "stream"),
        ("/v1/completions", {"prompt": [1.0, 2.0]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "stop_token_ids": [True]}, "stop_token_ids.0"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "0.5"}, "temperature"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 1}, "logprobs"),
        ("/v1/messages", {"messages": [{"role": "user", "content": "x"}], "max_tokens": "8"}, "max_tokens"),
    ],
)
def test_a_wrong_json_type_is_refused_naming_the_field(server, path, body, field):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    message = error_message(r)
    assert message.startswith(f"{field}: "), message
    if path != "/v1/messages":
        assert r.json()["error"]["param"] == field


def test_a_prompt_of_floats_is_named_as_what_it_is(server):
    message = error_message(post(server, "/v1/completions", {"prompt": [1.0, 2.0]}))
    assert message == "prompt: expected one of str, list[str], list[int], list[list[int]]; got a list of numbers"


# -- errors name the field, not an internal request id ------------------------------------------------


def test_an_empty_prompt_names_the_prompt(server):
    r = post(server, "/v1/completions", {"prompt": ""})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "prompt" and error["message"] == "prompt: the prompt has no tokens"


def test_the_refused_prompt_of_a_list_is_named_by_its_place(server):
    r = post(server, "/v1/completions", {"prompt": [[1, 2], [10**9]], "max_tokens": 2})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == "prompt.1" and error["message"].startswith("prompt.1: token ids must be ints in [0, ")


# -- clients that drop or stall ---------------------------------------------------------------------


def raw_post(port: int, path: str, body: bytes, declared: int | None = None, rcvbuf: int | None = None) -> socket.socket:
    """A POST sent by hand: ``declared`` may promise more body than is sent (a stalled upload)."""
    sock = socket.socket()
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)  # a client that never reads fills it soon
    sock.connect(("127.0.0.1", port))
    head = (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {declared if declared is not None else len(body)}\r\n\r\n")
    sock.sendall(head.encode() + body)
    return sock


def wait_closed(port: int, timeout: float) -> float:
    """When ``port`` stopped taking connections (fails the test after ``timeout`` seconds)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
        except OSError:
            return time.monotonic()
        time.sleep(0.05)
    pytest.fail(f"the server still listens {timeout:.0f} s after SIGTERM")


def test_a_client_dropping_mid_upload_writes_no_traceback(server):
    before = server.output()
    sock = raw_post(server.port, "/v1/completions", b'{"prompt": "abc', declared=100_000)
    time.sleep(0.3)
    sock.close()
    deadline = time.monotonic() + 5
    while "disconnected while sending the body" not in server.output() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert httpx.get(f"{server.url}/health").status_code == 200
    new = server.output()[len(before):]
    assert "Traceback" not in new and "Exception" not in new, new


def test_big_prompts_are_tokenized_off_the_event_loop(server):
    """6 prompts of ~0.9 MB each keep the tokenizer busy for seconds; meanwhile /health answers."""
    text = "def f(x):\n    return x + 1\n" * 33_000  # ~0.9 MB
    done = []

    def send(i):
        r = post(server, "/v1/completions", {"prompt": text + str(i), "max_tokens": 1}, timeout=300)
        done.append(r)

    senders = [threading.Thread(target=send, args=(i,)) for i in range(6)]
    began = time.monotonic()
    for t in senders:
        t.start()
    waits = []
    while any(t.is_alive() for t in senders):
        t0 = time.monotonic()
        assert httpx.get(f"{server.url}/health", timeout=60).status_code == 200
        waits.append(time.monotonic() - t0)
        time.sleep(0.02)
    busy = time.monotonic() - began
    assert all(r.status_code == 400 and "context length" in error_message(r) for r in done), [r.text for r in done]
    assert busy > 0.6, f"tokenizing took only {busy:.2f} s: too little to tell"
    # On the event loop, /health could answer only between two prompts' tokenizations: a handful of
    # answers in all, each waiting about a prompt's time. Off it, /health answers all along; a busy
    # CPU (the tokenizer threads hold the GIL in turns with the loop) slows some answers, which is
    # why the median is read rather than the slowest.
    waits.sort()
    median = waits[len(waits) // 2]
    assert len(waits) >= 8, f"/health answered {len(waits)} times in {busy:.2f} s of tokenizing"
    assert median < busy / 8, f"/health's median wait {median:.2f} s while {busy:.2f} s of prompts were tokenized"


# -- SIGTERM drain ----------------------------------------------------------------------------------


def test_the_drain_timeout_ends_the_process_whatever_the_clients_do():
    """A client stalled mid-upload and one that never reads its stream cannot hold the process
    past ``--drain-timeout`` (plus a moment); the choices the timeout cuts end with "stop"."""
    drain = 2.0
    # 2 x 32 sequences of 2000 tokens: seconds of work for the embedded model, so the drain cuts some
    long = {"prompt": [[1, 2, 3]] * 32, "max_tokens": 2000, "ignore_eos": True, "temperature": 0, "stream": True}
    with ServerProcess("--drain-timeout", str(drain)) as s:
        stalled = raw_post(s.port, "/v1/completions", b'{"prompt": "x', declared=10_000)
        deaf = raw_post(s.port, "/v1/completions", json.dumps({**long, "logprobs": 5}).encode(), rcvbuf=4096)
        chunks, first = [], threading.Event()

        def read():
            with httpx.stream("POST", f"{s.url}/v1/completions", json=long, timeout=60) as r:
                for line in r.iter_lines():
                    if line:
                        chunks.append(line)
                        first.set()

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        assert first.wait(60)
        began = time.monotonic()
        s.proc.send_signal(signal.SIGTERM)
        closed = wait_closed(s.port, timeout=drain + 20) - began  # the server is done: it no longer listens
        try:  # then the interpreter ends (torch's teardown takes seconds on a busy machine)
            code = s.proc.wait(30)
        except Exception:
            pytest.fail(f"still running 30 s after it stopped listening (--drain-timeout {drain})")
        reader.join(10)
        stalled.close()
        deaf.close()
        out = s.output()
    assert code == 0, out
    assert closed < drain + 2.5, f"the server stopped listening {closed:.1f} s after SIGTERM (--drain-timeout {drain})"
    assert chunks[-1] == "data: [DONE]", chunks[-3:]
    reasons = {}
    for line in chunks[:-1]:
        for choice in json.loads(line.removeprefix("data: "))["choices"]:
            if choice["finish_reason"] is not None:
                reasons[choice["index"]] = choice["finish_reason"]
    assert len(reasons) == 32, sorted(reasons)  # every choice ended, cut or not
    assert "stop" in reasons.values(), reasons  # cut by the server (ignore_eos: only a cut stops early)
    assert set(reasons.values()) <= {"stop", "length"}, reasons  # OpenAI values, not the engine's "abort"
    assert "Traceback" not in out, out[-3000:]
