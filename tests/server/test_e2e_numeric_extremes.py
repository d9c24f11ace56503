"""Numbers at and past their limits, on every generation route of a running server:
each is a 400 naming the field (or served, where the value is valid), never a 500
or a hang, and the server keeps serving between them."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import API_KEY

MESSAGES = [{"role": "user", "content": "hi"}]
CHAT_CASES = [
    ("max_tokens", 2**63, 400), ("max_tokens", -1, 400), ("n", 10**9, 400),
    ("top_logprobs", -1, 400), ("top_logprobs", 10**6, 400), ("temperature", 1e308, 400),
    ("seed", 2**64, 400), ("seed", -(2**63) - 1, 400), ("seed", -1, 200),
    ("top_p", 0, 400), ("presence_penalty", 1e308, 400), ("top_k", 10**12, 200),
    ("logit_bias", {"5": 1e308}, 400),
]

pytestmark = pytest.mark.slow


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {API_KEY}"})


@pytest.mark.parametrize("field, value, status", CHAT_CASES)
def test_chat_numbers_past_their_limits(server, field, value, status):
    body = {"model": "smollm2-135m-instruct", "messages": MESSAGES, "max_tokens": 4,
            field: value, **({"logprobs": True} if field == "top_logprobs" else {})}
    reply = _post(server, "/v1/chat/completions", body)
    assert reply.status_code == status, reply.text
    if status == 400:
        assert reply.json()["error"]["param"] == field
    assert httpx.get(f"{server.base_url}/health", timeout=30).status_code == 200


def test_nan_and_the_other_routes(server):
    nan = httpx.post(f"{server.base_url}/v1/chat/completions", timeout=60,
                     headers={"Authorization": f"Bearer {API_KEY}",
                              "Content-Type": "application/json"},
                     content='{"messages": [{"role": "user", "content": "hi"}], '
                             '"temperature": NaN}')
    assert nan.status_code == 400
    for path, body in (("/v1/completions", {"prompt": "hi", "max_tokens": 2**63}),
                       ("/v1/completions", {"prompt": "hi", "seed": 2**64}),
                       ("/v1/embeddings", {"input": "hi", "dimensions": 2**63}),
                       ("/v1/responses", {"input": "hi", "max_output_tokens": 2**63}),
                       ("/v1/messages", {"model": "x", "max_tokens": 2**63,
                                         "messages": MESSAGES})):
        reply = _post(server, path, body)
        assert reply.status_code == 400, (path, reply.text)
    assert _post(server, "/v1/chat/completions", {"messages": MESSAGES,
                                                  "max_tokens": 2}).status_code == 200
