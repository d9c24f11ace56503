"""PauseGate: lets callers park the engine thread between two steps (the manager's
`pause()` context), for work that must not race a step: resizing, swapping weights,
inspecting state.

    caller (any thread)                  engine thread
    acquire(wait) ─ count += 1, wake ──> park_while_held(): parked = True, notify
       waits until parked (or until        waits while count > 0
       wait() says the loop is gone)
    ... works on a quiet engine ...
    release() ─ count -= 1, notify ────> leaves when count == 0, steps again

Pauses nest and may come from several threads at once; `holds()` tells a thread
whether it is inside one (the manager refuses a blocking stop from inside a pause,
which would wait on itself).
"""

from __future__ import annotations

import threading
from typing import Callable

POLL_SECONDS = 0.05
"""Both sides re-check their condition at least this often."""


class PauseGate:
    def __init__(self, wake: Callable[[], None]) -> None:
        """`wake`: makes a blocked engine thread return to its loop (an inbox item)."""
        self._wake = wake
        self._condition = threading.Condition()
        self._count = 0
        self._holders: dict[int, int] = {}
        """Thread ident -> pauses it holds."""
        self._parked = False

    # -- any thread ----------------------------------------------------------------------
    def wanted(self) -> bool:
        """Whether some caller holds or waits for a pause."""
        return self._count > 0

    def holds(self) -> bool:
        """Whether the calling thread is inside a pause."""
        return self._holders.get(threading.get_ident(), 0) > 0

    def acquire(self, wait: Callable[[], bool]) -> None:
        """Enter a pause; returns once the engine thread is parked, or once `wait()`
        is False (no engine thread runs to park)."""
        with self._condition:
            self._count += 1
            ident = threading.get_ident()
            self._holders[ident] = self._holders.get(ident, 0) + 1
            self._wake()
            while wait() and not self._parked:
                self._condition.wait(timeout=POLL_SECONDS)

    def release(self) -> None:
        with self._condition:
            self._count -= 1
            ident = threading.get_ident()
            self._holders[ident] -= 1
            if not self._holders[ident]:
                del self._holders[ident]
            self._condition.notify_all()

    # -- engine thread -------------------------------------------------------------------
    def park_while_held(self, give_up: Callable[[], bool],
                        while_parked: Callable[[], None]) -> None:
        """Stay here while any pause is held, or until `give_up()` (a hard stop);
        `while_parked` runs at every poll (keeping tensor-parallel followers waiting)."""
        with self._condition:
            if self._count == 0:
                return
            self._parked = True
            self._condition.notify_all()
            while self._count > 0 and not give_up():
                self._condition.wait(timeout=POLL_SECONDS)
                while_parked()
            self._parked = False
