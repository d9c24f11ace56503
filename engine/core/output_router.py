"""OutputRouter: delivers GenerationOutputs from the engine thread to callers.

A request with a registered handler gets its outputs on the asyncio loop that was
running when the handler was registered (one `loop.call_soon_threadsafe` per loop
carries a step's outputs, handlers called in order), or directly on the engine thread
when none was; every other output goes to a shared thread-safe queue read by
`get_result`.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from typing import Callable

from ..outputs import GenerationOutput

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
        self.deliver_all([output])

    def deliver_all(self, outputs: list[GenerationOutput]) -> None:
        """Engine thread: one step's outputs, in order. The callbacks of one asyncio
        loop go over in one call_soon_threadsafe (one wake-up of the loop per step, not
        one per request: 32 streams, 32 -> 1 self-pipe writes each step)."""
        per_loop: dict[asyncio.AbstractEventLoop, list[tuple[Callable, GenerationOutput]]] = {}
        direct: list[tuple[Callable, GenerationOutput]] = []
        with self._lock:
            for output in outputs:
                if output.request_id in self._cancelled:
                    continue
                if output.is_finished():
                    handler = self._handlers.pop(output.request_id, None)
                else:
                    handler = self._handlers.get(output.request_id)
                if handler is None:
                    self.output_queue.put(output)
                elif handler[1] is None:
                    direct.append((handler[0], output))
                else:
                    per_loop.setdefault(handler[1], []).append((handler[0], output))
        _run_callbacks(direct)
        for loop, calls in per_loop.items():
            try:
                loop.call_soon_threadsafe(_run_callbacks, calls)
            except RuntimeError:  # the loop was closed: nobody is listening any more
                logger.debug("dropped %d outputs: their event loop is closed", len(calls))

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

    def num_pending(self) -> int:
        return self.output_queue.qsize()


def _run_callbacks(calls: list[tuple[Callable, GenerationOutput]]) -> None:
    """Each handler with its output; a caller's bug must not stop the others (nor,
    run on the engine thread, take the engine down)."""
    for callback, output in calls:
        try:
            callback(output)
        except Exception:
            logger.exception("result handler for %s raised", output.request_id)
