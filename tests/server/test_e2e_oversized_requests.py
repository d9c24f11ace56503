"""Requests built to be expensive to read: a flood of headers, one huge header, a 10 MB
`stop` string (JSON nested 100,000 deep is in test_e2e_schema_fuzz.py, whose server
has the default body limit). Each is a 4xx (in OpenAI's error shape where the request
reached the app), a flooding connection is closed, and the server answers a normal
request right after each."""

from __future__ import annotations

import json
import socket

import httpx
import pytest

from tests.server.conftest import API_KEY

pytestmark = pytest.mark.slow


def _raw_exchange(server, head_lines: list[str], body: bytes = b"{}"
                  ) -> tuple[int | None, bytes, bool]:
    """Send one request as raw bytes; (status, body, whether the server closed the
    connection after answering). A server that closes while the request is still
    arriving resets the connection, and its answer may be lost: (None, b"", True)."""
    try:
        return _exchange(server, head_lines, body)
    except (ConnectionResetError, BrokenPipeError):
        return None, b"", True


def _exchange(server, head_lines: list[str], body: bytes) -> tuple[int, bytes, bool]:
    host, port = server.base_url.removeprefix("http://").split(":")
    request = ("POST /v1/chat/completions HTTP/1.1\r\n"
               f"Host: {host}:{port}\r\nContent-Type: application/json\r\n"
               f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(body)}\r\n"
               + "".join(f"{line}\r\n" for line in head_lines) + "\r\n").encode() + body
    with socket.create_connection((host, int(port)), timeout=30) as connection:
        connection.sendall(request)
        received = b""
        while True:
            chunk = connection.recv(65536)
            if not chunk:
                closed = True
                break
            received += chunk
            head, _, rest = received.partition(b"\r\n\r\n")
            length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                           if line.lower().startswith(b"content-length:")), None)
            if length is not None and len(rest) >= length:
                connection.settimeout(2)
                try:
                    closed = connection.recv(1) == b""
                except socket.timeout:
                    closed = False
                break
    status = int(received.split(b" ", 2)[1])
    return status, received.partition(b"\r\n\r\n")[2], closed


def _still_serving(server) -> None:
    reply = httpx.post(f"{server.openai_base_url}/chat/completions", timeout=120,
                       headers=server.headers(),
                       json={"model": "smollm2-135m-instruct", "max_tokens": 2,
                             "messages": [{"role": "user", "content": "hi"}]})
    assert reply.status_code == 200, reply.text


def test_a_thousand_headers_are_a_431_and_the_connection_closes(server):
    status, body, closed = _raw_exchange(server, [f"X-Flood-{i}: {i}" for i in range(1000)])
    assert status == 431 and closed
    assert json.loads(body)["error"]["code"] == "too_many_headers"
    _still_serving(server)


def test_a_request_with_a_few_dozen_headers_is_served(server):
    status, body, _ = _raw_exchange(server, [f"X-Trace-{i}: {i}" for i in range(60)],
                                    json.dumps({"model": "smollm2-135m-instruct",
                                                "max_tokens": 1, "messages": [
                                                    {"role": "user", "content": "hi"}]}).encode())
    assert status == 200, body


def test_one_megabyte_header_is_refused_and_the_connection_closes(server):
    status, _, closed = _raw_exchange(server, ["X-Huge: " + "a" * 2**20])
    assert status in (400, 431, None) and closed
    _still_serving(server)


def test_a_ten_megabyte_stop_string_is_refused_by_size(server):
    body = {"model": "smollm2-135m-instruct", "max_tokens": 2, "stop": "x" * 10 * 2**20,
            "messages": [{"role": "user", "content": "hi"}]}
    reply = httpx.post(f"{server.openai_base_url}/chat/completions", json=body,
                       headers=server.headers(), timeout=120)
    assert reply.status_code == 413, reply.text
    assert "error" in reply.json()
    _still_serving(server)
