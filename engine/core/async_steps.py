"""Async batching: the host schedules step N+1 and queues it on the device before
reading back step N's tokens, so the device never waits for the host between decode
steps.

    sync:   [schedule N][launch N]....[read N][apply N][schedule N+1][launch N+1]...
    async:  [launch N][schedule N+1][launch N+1][read N][apply N][schedule N+2]...
                      \\____ while the device computes N ____/

Step N+1 feeds each request the token step N picks for it, gathered on the device
(ModelRunner.lookahead_inputs); nothing about step N+1 but those tokens depends on
step N's values, as long as step N+1 is the decode step the scheduler would build
anyway. `lookahead_batch` builds it only then:

- every request of step N picks a token, and they are all the running requests
  (none waits, none was left out for the budget, no copies to or from the CPU pool);
- none asks for penalties (they count step N's token, not read yet) or carries a
  grammar (its mask follows step N's token);
- requests that reach max_new_tokens at step N are left out (they finish for sure);
- each gets room for one more token without preempting anyone.

A request can still stop at step N on an EOS token: its row in step N+1 is wasted
(the token it picks is dropped) and it keeps its blocks until step N+1 is read back,
since step N+1 writes its K/V there. Blocks of step N+1's tokens that become full are
offered to the prefix cache once step N's tokens are known. Anything else (new
requests, a prefill, penalties, memory pressure) runs the ordinary step.

Cancellations, pauses and stops first read back the step in flight (`drain`). On a
CPU the device work runs at launch, so the order changes and nothing overlaps; the
engine turns async batching on by itself only where CUDA graphs replay decode steps.
Engine thread only.
"""

from __future__ import annotations

from ..step.runner import LaunchedStep
from .scheduler import ScheduledBatch, ScheduledRequest, Scheduler


def lookahead_batch(scheduler: Scheduler, batch: ScheduledBatch,
                    launched: LaunchedStep) -> ScheduledBatch | None:
    """Step N+1 built while step N (`batch`, `launched`) is in flight, or None when
    the ordinary schedule must decide it (see the module docstring)."""
    if (scheduler.waiting or batch.swap_out or batch.swap_in or not batch.entries
            or not all(entry.samples for entry in batch.entries)):
        return None
    requests = launched.requests
    if len(requests) != len(scheduler.running) or \
            {id(r) for r in requests} != {id(r) for r in scheduler.running}:
        return None
    live = [r for r in requests if not r.is_finished]
    if any(r.sampling.needs_token_counts or r.grammar is not None for r in live):
        return None
    # after step N a request holds len(generated) + 1 tokens; at the limit it is done
    going_on = [r for r in live if len(r.generated_tokens) + 1 < r.max_new_tokens]
    if not going_on:
        return None
    for request in going_on:     # step N+1 feeds position num_computed_tokens
        if not scheduler.blocks.grow(request, request.num_computed_tokens + 1):
            return None          # memory pressure: the ordinary schedule preempts
    entries = [ScheduledRequest(r, r.num_computed_tokens, 1, samples=True) for r in going_on]
    return ScheduledBatch(entries=entries, preempted=[])


class AsyncSteps:
    """Keeps at most one step in flight across calls of `step()`."""

    def __init__(self, loop) -> None:
        self.loop = loop
        self.in_flight: tuple[ScheduledBatch, LaunchedStep] | None = None
        self.num_lookahead_steps = 0
        """Steps queued before the previous step's tokens were read back."""

    def step(self) -> None:
        """Read back one step; before that, queue the next one when `lookahead_batch`
        allows."""
        loop = self.loop
        with loop.step_lock:
            if self.in_flight is None:
                batch = loop.scheduler.schedule()
                if batch is None:
                    return
                self.in_flight = (batch, loop.launch(batch))
            batch, launched = self.in_flight
            ahead = lookahead_batch(loop.scheduler, batch, launched)
            self.in_flight = None
            if ahead is not None:
                inputs = loop.runner.lookahead_inputs(ahead, launched)
                self.in_flight = (ahead, loop.launch(ahead, inputs))
                self.num_lookahead_steps += 1
            kept = {id(entry.request) for entry in ahead.entries} if ahead else set()
            outputs = loop.collect(launched, keep_blocks=kept)
            if ahead is not None:        # step N's tokens are in: full blocks are known
                for entry in ahead.entries:
                    if not entry.request.is_finished:
                        loop.scheduler.blocks.register_full_blocks(entry.request, entry.end)
        loop.deliver(outputs)

    def drain(self) -> None:
        """Read back the step in flight, queueing nothing after it."""
        if self.in_flight is None:
            return
        with self.loop.step_lock:
            _, launched = self.in_flight
            self.in_flight = None
            outputs = self.loop.collect(launched, keep_blocks=set())
        self.loop.deliver(outputs)
