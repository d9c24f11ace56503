"""A deliberate engine failure, for tests of what clients see when the engine dies.

Enabled only with `enable_fault_injection: true` (never in a deployment), it adds
POST /debug/fail-engine. The next engine step then raises inside the engine thread,
exactly where a real fault (a CUDA error, a bug in a model) would: the engine loop
catches it, fails every request it holds, and its thread ends. Nothing else is
simulated: the clients, the server and the engine all take their real paths.
"""

from __future__ import annotations

from typing import Any


class InjectedEngineFault(RuntimeError):
    """Raised inside the engine thread by an armed fault."""


def arm_engine_fault(manager: Any) -> None:
    """Make the manager's next forward pass raise InjectedEngineFault.

    The runner's `launch` is the one call every scheduled batch goes through, on the
    engine thread; replacing it on this instance touches no other manager.
    """
    runner = manager.loop.runner

    def failing_step(batch: Any, inputs: Any = None) -> Any:
        raise InjectedEngineFault("engine fault injected through /debug/fail-engine")

    runner.launch = failing_step
