"""OutputRouter.deliver_all: a step's outputs reach their handlers on the loop each was
registered from, in order, with one wake-up of that loop per step; a raising handler
does not stop the others; unregistered and cancelled requests go where they always
went (the shared queue, nowhere)."""

from __future__ import annotations

import asyncio
import threading

from engine.core.output_router import OutputRouter
from engine.outputs import GenerationOutput, RequestStatus


def _output(request_id: str, tokens: list[int], finished: bool = False) -> GenerationOutput:
    return GenerationOutput(request_id=request_id, prompt_ids=[1], generated_tokens=tokens,
                            status=RequestStatus.FINISHED if finished else RequestStatus.DECODING)


def test_a_steps_outputs_reach_their_loop_in_one_wake_up():
    router = OutputRouter()
    received: list[tuple[str, list[int]]] = []
    wake_ups = []

    async def register_all() -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counting(callback, *args):
            if getattr(callback, "__module__", "") == "engine.core.output_router":
                wake_ups.append(args)               # the router's, not asyncio's own
            return original(callback, *args)

        loop.call_soon_threadsafe = counting
        for name in ("a", "b", "c"):
            router.register(name, lambda out: received.append((out.request_id,
                                                                out.generated_tokens)))

        def broken(out):
            raise ValueError("a caller's bug")

        router.register("broken", broken)
        return loop

    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever)
    thread.start()
    try:
        asyncio.run_coroutine_threadsafe(register_all(), loop).result(timeout=10)
        router.cancel("c")
        router.deliver_all([_output("a", [5]), _output("broken", [1]), _output("b", [6]),
                            _output("c", [7]), _output("stray", [8]),
                            _output("b", [6, 9], finished=True)])
        asyncio.run_coroutine_threadsafe(asyncio.sleep(0), loop).result(timeout=10)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
    assert received == [("a", [5]), ("b", [6]), ("b", [6, 9])]
    assert len(wake_ups) == 1                       # one step, one loop: one wake-up
    assert router.output_queue.get_nowait().request_id == "stray"
    router.deliver(_output("b", [6, 9, 10]))        # b finished: its handler is gone
    assert router.output_queue.get_nowait().generated_tokens == [6, 9, 10]


def test_handlers_registered_off_a_loop_run_on_the_engine_thread():
    router = OutputRouter()
    seen = []
    router.register("x", lambda out: seen.append(threading.current_thread().name))
    router.deliver_all([_output("x", [1]), _output("x", [1, 2])])
    assert seen == [threading.current_thread().name] * 2
