"""Stored responses of /v1/responses (`store`, true unless a request says false):
what `previous_response_id` continues from, and what GET and DELETE
/v1/responses/{id} read.

Each entry keeps the response object as it was returned and its conversation as
chat messages (without the instructions, which a continuation does not inherit, as
OpenAI's API does not carry them over): the earlier turns, this request's input and
the answer (its text and function calls). A continuation's prompt is that history
followed by its own input, so the prefix cache finds the earlier turns' KV.

Bounded: at most `max_size` entries, each for `ttl_s` seconds; the oldest goes first.
Memory only: a restart forgets them all, and behind a router a conversation must
stay on the replica that stored it (docs/deployment.md). An entry made with an API
key is visible only with that key (a SHA-256 of it is kept, compared in constant
time). Event loop only.
"""

from __future__ import annotations

import hashlib
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..edge.errors import OpenAIError


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]
    history: list[dict[str, Any]]
    """The conversation through this response, as chat messages."""
    owner: bytes | None
    expires: float


def owner_of(key: str | None) -> bytes | None:
    return None if key is None else hashlib.sha256(key.encode("utf-8", "surrogateescape")).digest()


def not_found(response_id: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(f"Response with id '{response_id}' not found.", status_code=404,
                       param=param, code="response_not_found")


class ResponseStore:
    def __init__(self, max_size: int, ttl_s: float) -> None:
        self.max_size, self.ttl_s = max_size, ttl_s
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response_id: str, response: dict[str, Any], history: list[dict[str, Any]],
            key: str | None) -> None:
        if self.max_size == 0:
            return
        self._expire()
        self._entries[response_id] = StoredResponse(response, history, owner_of(key),
                                                    time.monotonic() + self.ttl_s)
        while len(self._entries) > self.max_size:
            self._entries.popitem(last=False)

    def get(self, response_id: str, key: str | None, param: str | None = None) -> StoredResponse:
        """The entry, or a 404 when it is unknown, expired, evicted or another key's."""
        self._expire()
        entry = self._entries.get(response_id)
        if entry is None or not _same_owner(entry.owner, owner_of(key)):
            raise not_found(response_id, param)
        return entry

    def delete(self, response_id: str, key: str | None) -> None:
        self.get(response_id, key)
        del self._entries[response_id]

    def _expire(self) -> None:
        now = time.monotonic()
        while self._entries:
            oldest = next(iter(self._entries.values()))
            if oldest.expires > now:
                return
            self._entries.popitem(last=False)


def _same_owner(stored: bytes | None, asking: bytes | None) -> bool:
    if stored is None:
        return True
    return asking is not None and secrets.compare_digest(stored, asking)
