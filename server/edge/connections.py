"""Connection hygiene: no client can hold the server's sockets hostage.

uvicorn's HTTP/1.1 protocol (h11) serves each connection; GuardedH11Protocol adds:

- a read deadline: a connection must deliver a complete request (head and body)
  within `request_read_timeout_s` of opening, or of its previous response; one that
  sends nothing (a silent connection) or a byte a second (slowloris) is closed then.
  Idle keep-alive connections close after uvicorn's keep-alive timeout as before.
- a cap on open connections (`max_connections`, by default what the file-descriptor
  limit leaves after a reserve for the model's files and the engine): past it, the
  oldest connection still waiting for its request is closed to make room, so a
  flood of silent connections cannot lock real clients out; when every connection
  is busy with a request, the newcomer gets a 503 in OpenAI's error shape.

`raise_file_limit` lifts the soft descriptor limit to the hard one at start, and
`quiet_accept_errors` makes the event loop log a failing `accept()` (out of file
descriptors) once per ACCEPT_LOG_INTERVAL_S with a count, instead of a traceback per
attempt.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from .errors import error_body

logger = logging.getLogger(__name__)

FD_RESERVE = 64
"""Descriptors kept for everything but client connections (model files, the engine's
threads, logs) when the cap comes from the file limit."""
ACCEPT_LOG_INTERVAL_S = 10.0


def raise_file_limit() -> int:
    """Lift the soft RLIMIT_NOFILE to the hard limit; returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def default_max_connections() -> int:
    return max(16, raise_file_limit() - FD_RESERVE)


@dataclass
class ConnectionGuard:
    """Limits shared by every connection of one server (event loop thread only)."""

    max_connections: int
    request_read_timeout_s: float
    waiting: "OrderedDict[int, GuardedH11Protocol]" = field(default_factory=OrderedDict)
    """Connections still waiting for a complete request, oldest first."""

    def protocol_class(self) -> type:
        """What uvicorn instantiates per connection (its `http` setting)."""
        return type("GuardedProtocol", (GuardedH11Protocol,), {"guard": self})


_BUSY = json.dumps(error_body("The server has too many open connections; retry shortly.",
                              "server_error", None, "too_many_connections")).encode()
_BUSY_RESPONSE = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
                  b"retry-after: 1\r\nconnection: close\r\ncontent-length: "
                  + str(len(_BUSY)).encode() + b"\r\n\r\n" + _BUSY)


class GuardedH11Protocol(H11Protocol):
    guard: ConnectionGuard
    """Set on the subclass ConnectionGuard.protocol_class makes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._read_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if len(self.connections) > self.guard.max_connections and not self._evict_one():
            transport.write(_BUSY_RESPONSE)
            transport.close()
            return
        self._arm()

    def _evict_one(self) -> bool:
        """Close the oldest connection still waiting for its request."""
        if not self.guard.waiting:
            return False
        _, oldest = self.guard.waiting.popitem(last=False)
        oldest._disarm()
        oldest.transport.close()
        return True

    def _arm(self) -> None:
        self._disarm()
        self._read_deadline = self.loop.call_later(self.guard.request_read_timeout_s,
                                                   self._read_timed_out)
        self.guard.waiting[id(self)] = self

    def _disarm(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None
        self.guard.waiting.pop(id(self), None)

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        self.guard.waiting.pop(id(self), None)
        logger.info("closing a connection that sent no complete request within %gs",
                    self.guard.request_read_timeout_s)
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.cycle is not None and not self.cycle.more_body and id(self) in self.guard.waiting:
            self._disarm()               # the request is all in: the app takes over

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing():
            self._arm()                   # the next request has the same deadline

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def quiet_accept_errors(loop: asyncio.AbstractEventLoop) -> None:
    """Log the loop's accept() failures once per ACCEPT_LOG_INTERVAL_S."""
    state = {"last": 0.0, "count": 0}
    default = loop.get_exception_handler()

    def handler(event_loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if "socket.accept() out of system resource" not in context.get("message", ""):
            if default is not None:
                return default(event_loop, context)
            return event_loop.default_exception_handler(context)
        state["count"] += 1
        now = time.monotonic()
        if now - state["last"] >= ACCEPT_LOG_INTERVAL_S:
            logger.error("accept() failed %d time(s) (%s): out of file descriptors?",
                         state["count"], context.get("exception"))
            state["last"], state["count"] = now, 0

    loop.set_exception_handler(handler)
