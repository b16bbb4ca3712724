"""The server's own OpenAPI schema (``/openapi.json``), fuzzed with schemathesis: whatever a
client sends that the schema allows, or nearly allows, no answer is a 5xx.

Bounded: a few generated requests per operation, on the embedded model with a short context (a
generated ``max_tokens`` cannot run long).
"""

import pytest

schemathesis = pytest.importorskip("schemathesis")
httpx = pytest.importorskip("httpx")
pytest.importorskip("fastapi")

from hypothesis import HealthCheck, given, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402

from layerzoo.server.process import ServerProcess  # noqa: E402


@pytest.fixture(scope="module")
def server():
    with ServerProcess("--max-model-len", "64") as s:
        yield s


@pytest.fixture(scope="module")
def api_schema(server):
    return schemathesis.openapi.from_url(f"{server.url}/openapi.json")


def test_the_schema_describes_the_request_bodies(server):
    schema = httpx.get(f"{server.url}/openapi.json").json()
    body = schema["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}
    models = schema["components"]["schemas"]
    assert {"CompletionRequest", "ChatCompletionRequest", "MessagesRequest", "ChatMessage", "TextPart"} <= set(models)
    assert "max_tokens" in models["MessagesRequest"]["required"]
    assert httpx.get(f"{server.url}/docs").status_code == 200


def test_no_request_gets_a_server_error(api_schema):
    """Each operation gets a few generated requests (schemathesis' pytest integration is driven by
    hand: its plugin does not run under pytest 9)."""
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions", "POST /v1/messages"}
    for operation in operations:

        @settings(max_examples=6, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def no_server_error(case):
            case.call_and_validate(checks=[not_a_server_error], timeout=60)

        no_server_error()
