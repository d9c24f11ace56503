"""End to end: silent, trickling and non-reading clients cannot starve the others.
The server runs with 256 file descriptors, so the floods below would exhaust them."""

import socket
import time

import httpx
import pytest

from tests.server.conftest import ENGINE_FLAGS, launch_server

MODEL = "smollm2-135m-instruct"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    yield from launch_server(tmp_path_factory, [
        "--api-key", "k", "--request-read-timeout", "3", *ENGINE_FLAGS],
        api_key="k", file_limit=256)


def open_silent(server, count):
    host, port = server.base_url.removeprefix("http://").split(":")
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)), timeout=5)
        sockets.append(sock)
    return sockets


def test_a_flood_of_silent_connections_does_not_lock_clients_out(guarded):
    log_before = guarded.log_path.stat().st_size
    sockets = open_silent(guarded, 400)
    try:
        started = time.monotonic()
        response = httpx.post(f"{guarded.openai_base_url}/chat/completions",
                              headers=guarded.headers(), timeout=10,
                              json={"model": MODEL, "max_tokens": 4,
                                    "messages": [{"role": "user", "content": "Hi"}]})
        assert response.status_code == 200 and time.monotonic() - started < 5
    finally:
        for sock in sockets:
            sock.close()
    assert guarded.log_path.stat().st_size - log_before < 5_000_000


def test_silent_and_trickling_connections_are_closed_after_the_read_timeout(guarded):
    silent, = open_silent(guarded, 1)
    trickle, = open_silent(guarded, 1)
    started = time.monotonic()
    closed_at = None
    request = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: " + b"a" * 50
    for byte in request:
        try:
            trickle.sendall(bytes([byte]))
        except OSError:
            closed_at = time.monotonic() - started
            break
        time.sleep(0.2)
        if time.monotonic() - started > 8:
            break
    silent.settimeout(8)
    assert silent.recv(1) == b""                 # closed by the server
    assert closed_at is not None and closed_at < 6, closed_at

