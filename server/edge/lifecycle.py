"""Running the app under uvicorn, and stopping it without dropping requests.

    SIGTERM (or Ctrl-C)
      -> the engine refuses new requests (503) and /ready answers 503   (begin_drain)
      -> the listener stays up meanwhile, so load balancers and probes see the 503,
         not a refused connection
      -> requests in flight, streams included, run to their end,
         for at most `drain_timeout_s`; whatever is left is then cancelled and
         answered with a 503 `server_shutting_down` (in-band + [DONE] for streams)
      -> once the engine holds no request: uvicorn closes the listening socket and
         finishes the responses still being written
      -> lifespan shutdown stops the engine and frees the KV cache
      -> the process exits with status 0

A second signal skips the wait: uvicorn shuts down at once.

Streams are not cut by the signal (sse.py's responses know nothing of it): the drain
deadline ends whatever is still running, in-band. One library default is changed:
uvicorn, once it has shut down, re-raises the signal it caught so that the default
action (death by SIGTERM) runs; we install handlers that make that re-raise a no-op,
so a clean drain ends with status 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType
from typing import Any

import uvicorn

from .connections import ConnectionGuard, default_max_connections
from ..settings import ServerSettings

logger = logging.getLogger(__name__)


DRAIN_POLL_S = 0.05
DRAIN_GRACE_S = 2.0
"""After the drain window, how long the cancelled requests get to answer their 503."""


class DrainingServer(uvicorn.Server):
    """uvicorn.Server that tells the app to drain when the first signal arrives."""

    def __init__(self, config: uvicorn.Config, app: Any) -> None:
        super().__init__(config)
        self._app = app

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """Runs on the event loop's thread (a signal handler)."""
        serving = getattr(self._app.state, "serving", None)
        if serving is None or serving.engine.draining:    # nothing to drain, or a 2nd signal
            return super().handle_exit(sig, frame)
        serving.engine.begin_drain(serving.settings.drain_timeout_s)
        stats = serving.engine.stats()
        logger.warning("received %s: draining %d running and %d waiting requests "
                       "(up to %gs)", signal.Signals(sig).name, stats["num_running"],
                       stats["num_waiting"], serving.settings.drain_timeout_s)
        loop = asyncio.get_running_loop()
        loop.call_soon_threadsafe(lambda: loop.create_task(self._exit_when_drained(
            sig, frame, serving.engine, serving.settings.drain_timeout_s)))

    async def _exit_when_drained(self, sig: int, frame: FrameType | None, engine: Any,
                                 drain_timeout_s: float) -> None:
        """Keep serving (503s) until the engine holds no request, or the drain window
        (plus a moment for its cancellations) has passed; then uvicorn's shutdown."""
        deadline = time.monotonic() + drain_timeout_s + DRAIN_GRACE_S
        while time.monotonic() < deadline and not self.should_exit:
            stats = engine.stats() if engine.is_running() else {}
            if not stats.get("num_running") and not stats.get("num_waiting"):
                break
            await asyncio.sleep(DRAIN_POLL_S)
        super().handle_exit(sig, frame)


def _ignore_reraised_signal(sig: int, frame: FrameType | None) -> None:
    """Installed after serving: uvicorn re-raises the signal it handled; the
    drain already happened, so there is nothing left to do."""


def serve(app: Any, settings: ServerSettings) -> None:
    """Serve `app` until a signal arrives and the drain is over."""
    guard = ConnectionGuard(settings.max_connections or default_max_connections(),
                            settings.request_read_timeout_s)
    config = uvicorn.Config(app, host=settings.host, port=settings.port,
                            log_level=settings.log_level, http=guard.protocol_class(),
                            timeout_graceful_shutdown=settings.drain_timeout_s,
                            # request_log.py writes one line per request instead.
                            access_log=False)
    server = DrainingServer(config, app)
    # uvicorn saves these as the "original" handlers and restores them before its
    # re-raise, so the re-raise lands here instead of killing the process.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, _ignore_reraised_signal)
    server.run()
