"""EventStreamResponse over the ASGI interface: events in order as `data:` lines, pings
while the stream is idle, the end of the body, and a client's disconnect cancelling
the stream (its cleanup runs, `on_close` once)."""

from __future__ import annotations

import asyncio

from server.edge.sse import DONE, PING, TEXT_SLOT, EventStreamResponse, TextEvents, event


def _run(response, disconnect_after_s: float | None = None) -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        if disconnect_after_s is None:
            await asyncio.Event().wait()        # the client never leaves
        await asyncio.sleep(disconnect_after_s)
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(asyncio.wait_for(response({"type": "http"}, receive, send), 10))
    return sent


def test_events_pings_and_the_end_of_the_body():
    closed = []

    async def events():
        yield event({"n": 1})
        await asyncio.sleep(0.25)               # idle: pings go out meanwhile
        yield DONE

    sent = _run(EventStreamResponse(events(), lambda: closed.append(True),
                                    ping_interval_s=0.05))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    headers = dict(sent[0]["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert b"content-length" not in headers
    bodies = [m["body"] for m in sent[1:]]
    assert bodies[0] == b'data: {"n":1}\n\n'
    assert bodies[-2:] == [b"data: [DONE]\n\n", b""] and not sent[-1]["more_body"]
    assert 2 <= bodies.count(PING) <= 6 and set(bodies[1:-2]) == {PING}
    assert closed == [True]


def test_a_disconnect_cancels_the_stream():
    closed, cleaned = [], []

    async def events():
        try:
            yield event({"n": 1})
            await asyncio.Event().wait()        # would wait forever for the next token
            yield DONE
        finally:
            cleaned.append(True)

    sent = _run(EventStreamResponse(events(), lambda: closed.append(True)),
                disconnect_after_s=0.1)
    assert [m.get("body") for m in sent[1:]] == [b'data: {"n":1}\n\n']
    assert cleaned == [True] and closed == [True]


def test_text_events_are_the_events_of_their_payloads():
    """Chunks rendered from a template are byte for byte the JSON encoding of the
    same payload, whatever the text holds (quotes, escapes, line separators, controls,
    characters outside the BMP), for each choice index; a header holding the slot
    itself falls back to the whole encoding."""
    def payload(index: int, text: str) -> dict:
        return {"id": "chatcmpl-1", "model": 'm "x"', "choices": [
            {"index": index, "delta": {"content": text}, "logprobs": None}], "usage": None}

    texts = [" hello", 'say "hi"\\n', "line\nnext\ttab", "\u2028\u2029", "\x00\x07\x1f",
             "日本語 🙂", "", "\ud83d"]
    chunks = TextEvents(payload)
    for index in (0, 3, 0):
        for text in texts:
            assert chunks(index, text) == event(payload(index, text))
    odd = TextEvents(lambda index, text: {"model": TEXT_SLOT, "text": text})
    assert odd(0, "a") == event({"model": TEXT_SLOT, "text": "a"})


def test_a_client_that_reads_nothing_is_cut_after_the_write_timeout():
    """A send blocks (full socket buffers); after write_timeout_s the stream is
    cancelled like a disconnect: its cleanup runs and on_close once, the generator
    stops producing."""
    closed, produced, cleaned = [], [], []

    async def events():
        try:
            for n in range(1000):
                produced.append(n)
                yield event({"n": n})
        finally:
            cleaned.append(True)

    async def receive() -> dict:
        await asyncio.Event().wait()            # never disconnects
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and produced and produced[-1] >= 3:
            await asyncio.Event().wait()        # the client stopped reading

    response = EventStreamResponse(events(), lambda: closed.append(True),
                                   write_timeout_s=0.3)

    async def main() -> float:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(response({"type": "http"}, receive, send), 5)
        return loop.time() - started

    elapsed = asyncio.run(main())
    assert 0.3 <= elapsed < 2 and closed == [True] and cleaned == [True]
    assert len(produced) == 4


def test_a_named_event_carries_its_event_line_before_its_data():
    from server.edge.sse import encode, event

    assert encode(event({"type": "response.created", "n": 1}, name="response.created")) == (
        b'event: response.created\ndata: {"type":"response.created","n":1}\n\n')
    assert encode(event({"n": 1})) == b'data: {"n":1}\n\n'
