"""AsyncEngine over a real manager on a tiny random Llama: per-request queues,
cancellation, and the engine's refusals mapped to HTTP errors."""

import asyncio
import time

import pytest

from engine import ContinuousBatchingConfig, GenerationConfig

from server.async_engine import AsyncEngine
from server.edge.errors import OpenAIError

GREEDY = {"do_sample": False}


@pytest.fixture
def engine(tiny_llama):
    model, _ = tiny_llama
    manager = model.init_continuous_batching(
        GenerationConfig(max_new_tokens=8, eos_token_id=[]),
        ContinuousBatchingConfig(page_size=4, num_blocks=32, per_request_processors=True))
    engine = AsyncEngine(manager)
    engine.start()
    yield engine
    engine.shutdown()


async def drain(stream):
    return [output async for output in stream]


def test_streams_one_output_per_token_and_finish(engine):
    async def scenario():
        streaming = engine.submit("a", [5, 6, 7], max_new_tokens=5, streaming=True,
                                  eos_token_id=[], sampling=GREEDY)
        single = engine.submit("b", [5, 6, 7], max_new_tokens=5, streaming=False,
                               eos_token_id=[], sampling=GREEDY)
        return await asyncio.gather(drain(streaming), drain(single))

    streamed, single = asyncio.run(scenario())
    assert [len(o.generated_tokens) for o in streamed] == [1, 2, 3, 4, 5]
    assert len(single) == 1 and single[0].finish_reason == "length"
    assert streamed[-1].generated_tokens == single[0].generated_tokens


def test_cancel_frees_the_request(engine):
    async def scenario():
        stream = engine.submit("long", [5, 6, 7], max_new_tokens=20, streaming=True,
                               eos_token_id=[], sampling=GREEDY)
        first = await stream.__anext__()
        stream.cancel()
        stream.cancel()  # idempotent
        return first, [o async for o in stream]

    first, after = asyncio.run(scenario())
    assert len(first.generated_tokens) == 1 and after == []
    deadline = time.monotonic() + 10
    while engine.stats()["num_running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    stats = engine.stats()
    assert stats["num_running"] == 0 and stats["num_waiting"] == 0


@pytest.mark.parametrize("prompt, max_new_tokens, sampling, status", [
    ([5] * 100, 100, GREEDY, 400),              # can never fit 32 blocks x 4 tokens
    ([], 4, GREEDY, 400),                       # empty prompt
    ([10**6], 4, GREEDY, 400),                  # token outside the vocabulary
    ([5, 6], 4, {"top_p": 0.0}, 400),           # engine-side sampling validation
])
def test_refusals_become_openai_errors(engine, prompt, max_new_tokens, sampling, status):
    async def scenario():
        engine.submit("bad", prompt, max_new_tokens=max_new_tokens, streaming=False,
                      eos_token_id=[], sampling=sampling)

    with pytest.raises(OpenAIError) as info:
        asyncio.run(scenario())
    assert info.value.status_code == status


def test_stopped_engine_is_503(engine):
    engine.stop()

    async def scenario():
        engine.submit("late", [5, 6], max_new_tokens=2, streaming=False, eos_token_id=[],
                      sampling=GREEDY)

    with pytest.raises(OpenAIError) as info:
        asyncio.run(scenario())
    assert info.value.status_code == 503


def test_ready_after_warmup_until_drain(engine):
    assert not engine.ready()          # started, not warmed up yet
    engine.warmup()
    assert engine.ready()
    engine.begin_drain()
    assert not engine.ready() and engine.is_running()

    async def scenario():
        engine.submit("late", [5, 6], max_new_tokens=2, streaming=False, eos_token_id=[],
                      sampling=GREEDY)

    with pytest.raises(OpenAIError) as info:
        asyncio.run(scenario())
    assert (info.value.status_code, info.value.code) == (503, "server_shutting_down")


class _Deadline:
    """StreamLimits that raise once `after_s` has passed, counting their checks."""

    def __init__(self, after_s: float) -> None:
        self.at = time.perf_counter() + after_s
        self.checks = 0

    def check(self) -> None:
        self.checks += 1
        if time.perf_counter() >= self.at:
            raise OpenAIError("past the deadline", status_code=504, code="request_timeout")

    def seconds_to_check(self) -> float:
        return max(0.0, self.at - time.perf_counter())


def test_a_waiting_stream_ends_when_its_limits_say_so(engine):
    """A stream waiting for output checks its limits on a tick timed by them (here
    at once), not only once per LIVENESS_POLL_S, and their error ends the wait."""
    async def scenario():
        stream = engine.submit("waits", [5, 6, 7], max_new_tokens=100, streaming=False,
                               eos_token_id=[], sampling=GREEDY)
        stream.limits = limits = _Deadline(0.0)
        started = time.perf_counter()
        try:
            await stream.__anext__()
        except OpenAIError as error:
            return error, limits.checks, time.perf_counter() - started
        finally:
            stream.cancel()
        return None, limits.checks, time.perf_counter() - started

    error, checks, waited = asyncio.run(scenario())
    assert error is not None and error.status_code == 504
    assert checks == 1 and waited < 0.5
