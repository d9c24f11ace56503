"""StepSync: the driver's per-step messages to the follower ranks.

Only the driver schedules. Each step it sends one StepPlan: the KV block copies of
preemption offload and the step's flat inputs (token ids, positions, attention
metadata; see engine/step/batch.py), built on the host so that every rank can move them to
its own device. Followers run exactly the plans they receive, in order, and stop at
a stop message. While the driver has nothing to run it sends an idle message now and
then, so the followers' blocking receive does not hit the control group's timeout.

Thread rules: the driver sends from its engine thread and from a caller running
`warmup()`; a lock keeps their broadcasts whole and in one order. A follower receives
on its engine thread.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import Any

import torch

from .group import TensorParallelGroup


@dataclass(frozen=True)
class StepPlan:
    swap_out: list                      # (device blocks, host blocks) to copy out
    swap_in: list                       # (host blocks, device blocks) to copy in
    inputs: Any                         # engine.step.batch.StepInputs on the host, or None
    prefix_copies: list = ()            # (source block, target block, slots), after swaps


_IDLE, _STOP = "idle", "stop"


class StepSync:
    def __init__(self, group: TensorParallelGroup, timeout_s: float | None) -> None:
        self.group = group
        # well inside the timeout, and often enough that a follower notices a dead
        # driver within the timeout, not twice it
        self.idle_interval_s = 30.0 if timeout_s is None else max(0.05, min(30.0, timeout_s / 4))
        self._last_sent = time.monotonic()
        self._send_lock = threading.Lock()
        """One broadcast at a time: a warmup step (caller's thread) and an idle
        message (engine thread) must not interleave their collectives."""

    @property
    def is_driver(self) -> bool:
        return self.group.is_driver

    # -- driver ------------------------------------------------------------------------
    def send_plan(self, plan: StepPlan) -> None:
        self._send(plan)

    def send_idle_if_due(self) -> None:
        if time.monotonic() - self._last_sent >= self.idle_interval_s:
            self._send(_IDLE)

    def send_stop(self) -> None:
        self._send(_STOP)

    def _send(self, message: Any) -> None:
        with self._send_lock:
            self.group.broadcast(message)
            self._last_sent = time.monotonic()

    # -- follower ----------------------------------------------------------------------
    def receive(self) -> StepPlan | None:
        """The next plan, or None when the driver stopped the engine."""
        while True:
            message = self.group.broadcast()
            if message == _STOP:
                return None
            if message != _IDLE:
                return message


def to_device(value: Any, device: torch.device) -> Any:
    """`value` with every tensor inside it (dataclasses, lists, tuples) on `device`."""
    if isinstance(value, torch.Tensor):
        return value.to(device, non_blocking=True)
    if is_dataclass(value) and not isinstance(value, type):
        return replace(value, **{f.name: to_device(getattr(value, f.name), device)
                                 for f in fields(value) if f.init})
    if isinstance(value, (list, tuple)):
        return type(value)(to_device(item, device) for item in value)
    return value
