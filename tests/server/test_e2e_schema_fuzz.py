"""Every route of the OpenAPI document, fuzzed from it (schemathesis, property-based):
bodies the document allows and bodies it does not, against a running server.

Checks per answer: never a 5xx; a body the document forbids is refused (4xx), so the
document is no looser than the validation; every 4xx has the route's error shape
(the document's `4XX` answer: OpenAI's, or Anthropic's on /v1/messages); an answer
within its time. After the run the server still serves. The server's context is 128
tokens (8 blocks of 16), so a fuzzed request that generates stays short."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import negative_data_rejection, response_schema_conformance

from tests.server.conftest import launch_server

pytestmark = pytest.mark.slow

ANSWER_WITHIN_S = 60
EXAMPLES = 40
"""Examples per route and mode: about 20 routes x 2 modes x 40 in about a minute."""


@pytest.fixture(scope="module")
def fuzzed_server(tmp_path_factory):
    yield from launch_server(tmp_path_factory, [
        "--api-key", "fuzz-key", "--page-size", "16", "--num-blocks", "8"],
        api_key="fuzz-key")


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    document = httpx.get(f"{fuzzed_server.base_url}/openapi.json",
                         headers=fuzzed_server.headers(), timeout=30).json()
    return schemathesis.openapi.from_dict(document)


def _fuzz(operation, mode: GenerationMode, server) -> None:
    @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.generate])
    @given(case=operation.as_strategy(generation_mode=mode))
    def one(case):
        response = case.call_and_validate(
            base_url=server.base_url, headers=server.headers(),
            checks=[not_a_server_error, negative_data_rejection, response_schema_conformance],
            timeout=ANSWER_WITHIN_S)
        assert response.status_code < 500 or response.status_code == 503, response.text

    one()


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE],
                         ids=["allowed-bodies", "forbidden-bodies"])
def test_every_route_holds_under_fuzzed_requests(api_schema, fuzzed_server, mode):
    failures = []
    operations = [result.ok() for result in api_schema.get_all_operations()]
    assert len(operations) >= 15
    if mode is GenerationMode.NEGATIVE:     # only a body can be made to break its schema
        operations = [operation for operation in operations if operation.method == "post"]
    for operation in operations:
        try:
            _fuzz(operation, mode, fuzzed_server)
        except Exception as failure:      # noqa: BLE001 - collected, reported together
            failures.append(f"{operation.label}: {str(failure)[:1500]}")
    assert not failures, "\n\n".join(failures)


def test_the_server_serves_after_the_fuzzing(fuzzed_server, api_schema):
    reply = httpx.post(f"{fuzzed_server.base_url}/v1/chat/completions", timeout=120,
                       headers=fuzzed_server.headers(),
                       json={"model": "smollm2-135m-instruct", "max_tokens": 2,
                             "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200, reply.text


def test_json_nested_a_hundred_thousand_deep_is_a_400(fuzzed_server):
    nested = b'{"model": "smollm2-135m-instruct", "messages": ' + b"[" * 100_000 \
        + b"]" * 100_000 + b"}"
    reply = httpx.post(f"{fuzzed_server.base_url}/v1/chat/completions", content=nested,
                       headers={**fuzzed_server.headers(), "content-type": "application/json"},
                       timeout=120)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["code"] == "invalid_json"


def test_the_document_gives_every_body_route_its_schema_and_error_shape(api_schema):
    document = api_schema.raw_schema
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            answer = operation["responses"]["4XX"]["content"]["application/json"]["schema"]
            shape = "AnthropicError" if path.startswith("/v1/messages") else "OpenAIError"
            assert answer["$ref"].endswith(shape), (method, path)
            if method == "post":
                body = operation["requestBody"]["content"]["application/json"]["schema"]
                assert body["$ref"].split("/")[-1] in document["components"]["schemas"]
