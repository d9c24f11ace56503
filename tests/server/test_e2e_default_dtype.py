"""`python -m server` with no `--dtype` on the default model's GGUF: `auto` serves its
blocks with int8 activations on this CPU's int8 loop and says why in the load log, and
streamed and plain chat completions come back as with float32 (the same shape of
answer; the tokens may differ from float32's, as quantized activations round
differently)."""

from __future__ import annotations

import httpx
import pytest

from tests.server.conftest import API_KEY, ENGINE_FLAGS, launch_server


@pytest.fixture(scope="module")
def int8_server(tmp_path_factory):
    yield from launch_server(tmp_path_factory, ["--api-key", API_KEY, "--log-level", "info",
                                                *ENGINE_FLAGS], env={"KVSERVE_DTYPE": "auto"})


def test_the_default_serves_int8_forms_and_the_log_says_why(int8_server):
    log = int8_server.log_path.read_text(errors="replace")
    assert "I8_Q4" in log and "no dense copy" in log
    assert "int8-activations (activations float32; auto: int8 activations on the GGUF's" in log


def test_chat_completions_answer_on_int8_activations(int8_server):
    headers = {"Authorization": f"Bearer {API_KEY}"}
    body = {"model": "smollm2-135m-instruct", "max_tokens": 12, "temperature": 0,
            "messages": [{"role": "user", "content": "Name a color."}]}
    reply = httpx.post(f"{int8_server.base_url}/v1/chat/completions", json=body,
                       headers=headers, timeout=60)
    assert reply.status_code == 200
    answer = reply.json()
    assert answer["choices"][0]["message"]["content"].strip()
    assert answer["usage"]["completion_tokens"] > 0
    with httpx.stream("POST", f"{int8_server.base_url}/v1/chat/completions",
                      json={**body, "stream": True}, headers=headers, timeout=60) as stream:
        events = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) > 3
