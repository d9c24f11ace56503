"""The stored responses' bounds (server/openai_api/responses_store.py): the oldest evicted past
the count, entries gone after their TTL, another key's entries invisible, size 0
storing nothing."""

from __future__ import annotations

import pytest

from server.edge.errors import OpenAIError
from server.openai_api.responses_store import ResponseStore


def _put(store: ResponseStore, name: str, key: str | None = None) -> None:
    store.put(name, {"id": name}, [{"role": "user", "content": name}], key)


def test_the_oldest_goes_first_past_the_count():
    store = ResponseStore(2, ttl_s=60)
    for name in ("a", "b", "c"):
        _put(store, name)
    assert len(store) == 2
    with pytest.raises(OpenAIError) as gone:
        store.get("a", None)
    assert gone.value.status_code == 404 and gone.value.code == "response_not_found"
    assert store.get("c", None).history == [{"role": "user", "content": "c"}]


def test_entries_expire(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr("server.openai_api.responses_store.time.monotonic", lambda: clock[0])
    store = ResponseStore(10, ttl_s=5)
    _put(store, "a")
    clock[0] = 104.0
    assert store.get("a", None).response == {"id": "a"}
    clock[0] = 105.5
    with pytest.raises(OpenAIError):
        store.get("a", None)
    assert len(store) == 0


def test_a_keyed_entry_is_its_keys_alone_and_size_zero_stores_nothing():
    store = ResponseStore(10, ttl_s=60)
    _put(store, "a", key="k1")
    assert store.get("a", "k1").response == {"id": "a"}
    for other in ("k2", None):
        with pytest.raises(OpenAIError):
            store.get("a", other)
        with pytest.raises(OpenAIError):
            store.delete("a", other)
    store.delete("a", "k1")
    assert len(store) == 0
    empty = ResponseStore(0, ttl_s=60)
    _put(empty, "a")
    assert len(empty) == 0
