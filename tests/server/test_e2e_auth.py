"""API keys: the matrix of routes x credentials on the real server, plus the
settings side (several keys, the environment variable, open paths)."""

import httpx
import openai
import pytest

from server.edge.auth import key_matches
from server.cli import parse_settings
from server.settings import SettingsError
from tests.server.conftest import API_KEY, SECOND_API_KEY

MODEL = "smollm2-135m-instruct"

CREDENTIALS = {
    "none": None,
    "wrong": f"Bearer not-{API_KEY}",
    "prefix": f"Bearer {API_KEY[:-1]}",
    "longer": f"Bearer {API_KEY}x",
    "not bearer": f"Basic {API_KEY}",
    "right": f"Bearer {API_KEY}",
    "second": f"Bearer {SECOND_API_KEY}",
}
GRANTED = {"right", "second"}

PROTECTED = [
    ("GET", "/v1/models", None),
    ("GET", f"/v1/models/{MODEL}", None),
    ("POST", "/v1/chat/completions",
     {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 1}),
    ("POST", "/tokenize", {"model": MODEL, "prompt": "hi"}),
    ("POST", "/detokenize", {"model": MODEL, "tokens": [1, 2]}),
]
OPEN = [("GET", "/health", None), ("GET", "/ready", None), ("GET", "/metrics", None)]


def call(server, method, path, body, credential):
    headers = {} if credential is None else {"Authorization": credential}
    return httpx.request(method, server.base_url + path, json=body, headers=headers, timeout=60)


@pytest.mark.slow
@pytest.mark.parametrize("method, path, body", PROTECTED)
@pytest.mark.parametrize("who", list(CREDENTIALS))
def test_protected_routes(server, method, path, body, who):
    response = call(server, method, path, body, CREDENTIALS[who])
    if who in GRANTED:
        assert response.status_code == 200, response.text
    else:
        assert response.status_code == 401, response.text
        error = response.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == "invalid_api_key"
        assert set(error) == {"message", "type", "param", "code"}


@pytest.mark.slow
@pytest.mark.parametrize("method, path, body", OPEN)
@pytest.mark.parametrize("who", ["none", "wrong", "right"])
def test_probes_and_metrics_stay_open(server, method, path, body, who):
    assert call(server, method, path, body, CREDENTIALS[who]).status_code == 200


@pytest.mark.slow
def test_sdk_with_the_second_key(server):
    client = openai.OpenAI(base_url=server.openai_base_url, api_key=SECOND_API_KEY,
                           max_retries=0)
    assert [m.id for m in client.models.list()] == [MODEL]


def test_key_matching_is_exact():
    keys = ["alpha", "beta"]
    assert key_matches("alpha", keys) and key_matches("beta", keys)
    for token in ["", "alph", "alphaa", "ALPHA", "alpha beta", "gamma", "\udcff"]:
        assert not key_matches(token, keys), token
    assert not key_matches("alpha", [])


def test_keys_from_flag_env_and_file(tmp_path):
    config = tmp_path / "keys.yaml"
    config.write_text("api_key: file-key\n")
    file_only = parse_settings(["--config", str(config)], environ={})
    assert file_only.api_key == ["file-key"]
    from_env = parse_settings(["--config", str(config)],
                              environ={"KVSERVE_API_KEY": "env-1, env-2,"})
    assert from_env.api_key == ["env-1", "env-2"]
    from_flag = parse_settings(["--config", str(config), "--api-key", "a", "b"],
                               environ={"KVSERVE_API_KEY": "env-1"})
    assert from_flag.api_key == ["a", "b"]
    assert parse_settings([], environ={"KVSERVE_API_KEY": ""}).api_key is None
    config.write_text("api_key: [k1, k2]\nopen_paths: [/health]\n")
    listed = parse_settings(["--config", str(config)], environ={})
    assert (listed.api_key, listed.open_paths) == (["k1", "k2"], ["/health"])
    assert parse_settings(["--open-paths"], environ={}).open_paths == []


@pytest.mark.parametrize("text", ["api_key: ''\n", "api_key: []\n", "api_key: 5\n"])
def test_bad_keys_are_named(tmp_path, text):
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    with pytest.raises(SettingsError, match="'api_key"):
        parse_settings(["--config", str(config)], environ={})
