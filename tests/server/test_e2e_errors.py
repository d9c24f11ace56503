"""End to end: bad requests get the right 4xx in OpenAI's error shape, and the
server keeps serving afterwards."""

import httpx
import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "smollm2-135m-instruct"  # the model the `server` fixture serves
MSG = [{"role": "user", "content": "hi"}]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"

CASES = [
    # (path, body, status, param)
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[1, 2, 3]", 400, None),
    (CHAT, b"[" * 30_000 + b"]" * 30_000, 400, None),
    (CHAT, b'{"messages": ' + b"[" * 900 + b"]" * 900 + b"}", 400, None),
    (CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}'
     % MODEL.encode(), 400, None),
    (CHAT, b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}'
     % MODEL.encode(), 400, None),
    (CHAT, {"model": MODEL}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": "hi"}, 400, "messages"),
    (CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"model": MODEL, "messages": [{"role": "user", "content": {"a": 1}}]}, 400,
     "messages[0].content"),
    (CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 1.5}, 400, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": MSG, "temperature": 2.1}, 400, "temperature"),
    (CHAT, {"model": MODEL, "messages": MSG, "temperature": -0.1}, 400, "temperature"),
    (CHAT, {"model": MODEL, "messages": MSG, "top_p": 0}, 400, "top_p"),
    (CHAT, {"model": MODEL, "messages": MSG, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {"model": MODEL, "messages": MSG, "n": 0}, 400, "n"),
    (CHAT, {"model": MODEL, "messages": MSG, "presence_penalty": 2.5}, 400, "presence_penalty"),
    (CHAT, {"model": MODEL, "messages": MSG, "frequency_penalty": -3}, 400, "frequency_penalty"),
    (CHAT, {"model": MODEL, "messages": MSG, "logit_bias": {"999999": 5}}, 400, "logit_bias"),
    (CHAT, {"model": MODEL, "messages": MSG, "logit_bias": {"²": 5}}, 400, "logit_bias"),
    (CHAT, {"model": MODEL, "messages": MSG, "logit_bias": {"١": 5}}, 400, "logit_bias"),
    (CHAT, {"model": MODEL, "messages": MSG, "stop_token_ids": [10**9]}, 400, "stop_token_ids"),
    (CHAT, {"model": MODEL, "messages": MSG, "tools": [{"type": "function"}]}, 400,
     "tools[0].function"),
    (CHAT, {"model": MODEL, "messages": MSG, "functions": [{"name": "f"}]}, 400, "functions"),
    (CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 10**12}, 400, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": MSG, "stream": True, "max_tokens": -1}, 400, "max_tokens"),
    (CHAT, {"model": MODEL, "messages": MSG, "stream": True, "temperature": "hot"}, 400,
     "temperature"),
    (CHAT, {"model": "gpt-4o", "messages": MSG}, 404, "model"),
    (CHAT, {"model": "gpt-4o", "messages": MSG, "stream": True}, 404, "model"),
    (COMPLETIONS, {"model": MODEL}, 400, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": [1, 10**9]}, 400, "prompt"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "logprobs": 50}, 400, "logprobs"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "suffix": "x"}, 400, "suffix"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi", "best_of": 2}, 400, "best_of"),
    (COMPLETIONS, {"model": MODEL, "prompt": "hi " * 5000, "max_tokens": 8}, 400, None),
]


def send(server, path, body, **kwargs):
    headers = {**server.headers(), "content-type": "application/json"}
    if isinstance(body, bytes):
        return httpx.post(server.base_url + path, content=body, headers=headers, timeout=60, **kwargs)
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=60, **kwargs)


def assert_openai_error(response, status, param=None):
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["message"]
    if param is not None:
        assert body["error"]["param"] == param, body


def assert_still_serving(server):
    response = send(server, CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 2})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path, body, status, param", CASES)
def test_bad_input_table(server, path, body, status, param):
    assert_openai_error(send(server, path, body), status, param)


def test_server_still_serves_after_the_table(server):
    for path, body, _, _ in CASES:
        send(server, path, body)
    assert_still_serving(server)


def test_context_length_message(server):
    response = send(server, CHAT, {"model": MODEL, "messages": MSG, "max_tokens": 10**12})
    assert "context length" in response.json()["error"]["message"]
    assert response.json()["error"]["code"] == "context_length_exceeded"


def test_explicit_nulls_mean_defaults(server):
    body = {"model": MODEL, "messages": MSG, "max_tokens": 2, "temperature": None, "top_p": None,
            "n": None, "stop": None, "seed": None, "stream": None, "logprobs": None,
            "stream_options": None, "user": None, "logit_bias": None}
    assert send(server, CHAT, body).status_code == 200


@pytest.mark.parametrize("content", ["nul \x00 byte", "lone \ud800 surrogate", "bell \x07\x1b[31m",
                                     "\ufeff\u202e mixed", ""])
def test_odd_content_never_5xx(server, content):
    body = ('{"model": "%s", "messages": [{"role": "user", "content": %s}], "max_tokens": 2}'
            % (MODEL, _json_string(content))).encode()
    response = send(server, CHAT, body)
    assert response.status_code == 200, response.text


def _json_string(text: str) -> str:
    """JSON string literal with \\u escapes for everything non-printable (lone
    surrogates included, which json.dumps of a str cannot produce as raw UTF-8)."""
    return '"' + "".join(c if c.isalnum() or c == " " else "\\u%04x" % ord(c) for c in text) + '"'


def test_body_too_large_is_413(server):
    big = {"model": MODEL, "messages": [{"role": "user", "content": "x" * 70_000}]}
    assert_openai_error(send(server, CHAT, big), 413)
    assert_still_serving(server)


def test_api_key_is_required(server):
    response = httpx.post(server.base_url + CHAT, json={"model": MODEL, "messages": MSG})
    assert_openai_error(response, 401)
    bad = openai.OpenAI(base_url=server.openai_base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_unknown_route_and_method(server):
    assert_openai_error(httpx.get(server.base_url + "/v1/nothing", headers=server.headers()), 404)
    assert_openai_error(httpx.get(server.base_url + CHAT, headers=server.headers()), 405)


def test_sdk_sees_typed_errors(client):
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="nope", messages=MSG)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=MSG, temperature=5, stream=True)
    assert info.value.body["param"] == "temperature"
