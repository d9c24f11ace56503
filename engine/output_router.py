"""OutputRouter: delivers GenerationOutputs from the engine thread to callers.

A request with a registered handler gets its outputs through
`loop.call_soon_threadsafe(callback, output)` on the asyncio loop that was running
when the handler was registered (or directly on the engine thread when none was);
every other output goes to a shared thread-safe queue read by `get_result`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Callable

from .outputs import GenerationOutput

logger = logging.getLogger(__name__)


class OutputRouter:
    def __init__(self) -> None:
        self.output_queue: queue.Queue[GenerationOutput] = queue.Queue()
        self._handlers: dict[str, tuple[Callable, asyncio.AbstractEventLoop | None]] = {}
        self._lock = threading.Lock()
        self._cancelled: set[str] = set()

    def register(self, request_id: str, callback: Callable[[GenerationOutput], None]) -> None:
        """Any thread. Call before `add_request` so no output can slip past."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        with self._lock:
            self._handlers[request_id] = (callback, loop)

    def cancel(self, request_id: str) -> None:
        """Any thread. Drop the handler and any output still produced for the request
        until the engine thread has removed it (`forget`)."""
        with self._lock:
            self._handlers.pop(request_id, None)
            self._cancelled.add(request_id)

    def forget(self, request_id: str) -> None:
        """Engine thread, once a cancelled request is gone."""
        with self._lock:
            self._cancelled.discard(request_id)

    def deliver(self, output: GenerationOutput) -> None:
        """Engine thread. Finished requests drop their handler after delivery."""
        with self._lock:
            if output.request_id in self._cancelled:
                return
            if output.is_finished():
                handler = self._handlers.pop(output.request_id, None)
            else:
                handler = self._handlers.get(output.request_id)
        if handler is None:
            self.output_queue.put(output)
            return
        callback, loop = handler
        if loop is None:
            try:
                callback(output)
            except Exception:  # a caller's bug must not take the engine thread down
                logger.exception("result handler for %s raised", output.request_id)
            return
        try:
            loop.call_soon_threadsafe(callback, output)
        except RuntimeError:  # the loop was closed: nobody is listening any more
            logger.debug("dropped output for %s: its event loop is closed", output.request_id)

    def get(self, request_id: str | None, timeout: float | None,
            block: bool = True) -> GenerationOutput | None:
        """Next queued result; with `request_id`, a non-matching head is put back and
        None returned."""
        try:
            result = self.output_queue.get(block=block, timeout=timeout)
        except queue.Empty:
            return None
        if request_id is not None and result.request_id != request_id:
            self.output_queue.put(result)
            return None
        return result

    def has_pending(self) -> bool:
        return not self.output_queue.empty()
