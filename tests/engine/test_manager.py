"""Manager semantics (SPEC section 3) on a tiny real model."""

import asyncio
import threading
import time

import pytest

from engine import ContinuousBatchingConfig, GenerationConfig, RequestStatus
from engine.errors import InvalidRequestError, QueueFullError, RequestTooLongError

from tests.helpers import random_prompts, reference_greedy


def make_manager(model, max_new_tokens=8, **config):
    config.setdefault("page_size", 4)
    config.setdefault("num_blocks", 64)
    return model.init_continuous_batching(
        GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=[]),
        ContinuousBatchingConfig(**config))


def collect(manager, ids, timeout=60):
    results, deadline = {}, time.monotonic() + timeout
    while len(results) < len(ids) and time.monotonic() < deadline:
        result = manager.get_result(timeout=0.2)
        if result is not None and result.is_finished():
            results[result.request_id] = result
    return results


def wait_until(predicate, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_stop_lets_queued_requests_finish(tiny_llama):
    model, _ = tiny_llama
    manager = make_manager(model)
    manager.start()
    ids = manager.add_requests(random_prompts(6, 2, 20, seed=1))
    manager.stop(block=True)
    assert not manager.is_running()
    results = collect(manager, ids, timeout=1)
    assert sorted(results) == sorted(ids)
    assert all(r.status is RequestStatus.FINISHED and len(r.generated_tokens) == 8
               for r in results.values())
    assert all(r.created_time <= r.first_scheduled_time for r in results.values())
    assert manager.add_request([5, 6]) is None          # refused after stop
    manager.check_invariants()
    manager.start()                                      # a stopped manager restarts
    rid = manager.add_request([5, 6, 7])
    assert collect(manager, [rid])[rid].status is RequestStatus.FINISHED
    manager.destroy()
    manager.destroy()                                    # idempotent
    with pytest.raises(RuntimeError):
        manager.start()


def test_hard_stop_fails_pending_requests_with_runtime_error(tiny_llama):
    model, _ = tiny_llama
    manager = make_manager(model, max_new_tokens=200, num_blocks=256)
    manager.start()
    ids = manager.add_requests(random_prompts(8, 10, 30, seed=2))
    manager.stop(block=True, hard_stop=True)
    results = collect(manager, ids, timeout=2)
    assert sorted(results) == sorted(ids)
    assert all(r.status is RequestStatus.FAILED and "RuntimeError" in r.error
               for r in results.values())
    stats = manager.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    manager.check_invariants()
    manager.destroy()


def test_cancel_frees_the_request_blocks(tiny_llama):
    model, _ = tiny_llama
    manager = make_manager(model, max_new_tokens=300, num_blocks=128)
    manager.start()
    rid = manager.add_request(list(range(3, 40)), streaming=True)
    assert manager.get_result(rid, timeout=10) is not None      # it is running
    assert manager.stats()["num_free_blocks"] < 128
    manager.cancel_request(rid)
    assert wait_until(lambda: manager.stats()["num_free_blocks"] == 128)
    assert manager.stats()["num_running"] == 0
    manager.check_invariants()
    manager.stop()
    manager.destroy()


def test_pause_keeps_in_flight_requests_and_resumes(tiny_llama):
    model, reference = tiny_llama
    manager = make_manager(model, max_new_tokens=40)
    manager.start()
    prompt = list(range(10, 30))
    rid = manager.add_request(prompt, streaming=True)
    assert manager.get_result(rid, timeout=10) is not None
    with manager.pause():
        with manager.pause():                       # nested holders
            steps = manager.stats()["num_steps"]
            time.sleep(0.2)
            assert manager.stats()["num_steps"] == steps      # nothing runs while paused
    tokens = None
    for output in manager.request_id_iter(rid):
        tokens = output.generated_tokens
    assert tokens == reference_greedy(reference, prompt, 40)
    manager.stop()
    manager.check_invariants()
    manager.destroy()


def test_result_handlers_run_on_the_event_loop_thread(tiny_llama):
    model, _ = tiny_llama
    manager = make_manager(model, max_new_tokens=5)
    manager.start()

    async def main():
        loop_thread = threading.get_ident()
        queue, seen_threads = asyncio.Queue(), set()

        def on_result(output):
            seen_threads.add(threading.get_ident())
            queue.put_nowait(output)

        manager.register_result_handler("streamed", on_result)
        manager.add_request([4, 5, 6], request_id="streamed", streaming=True)
        outputs = [await asyncio.wait_for(queue.get(), 30)]
        while not outputs[-1].is_finished():
            outputs.append(await asyncio.wait_for(queue.get(), 30))
        return loop_thread, seen_threads, outputs

    loop_thread, seen_threads, outputs = asyncio.run(main())
    assert seen_threads == {loop_thread}
    assert [len(o.generated_tokens) for o in outputs] == [1, 2, 3, 4, 5]
    assert outputs[-1].status is RequestStatus.FINISHED and outputs[-1].finish_reason == "length"
    assert manager.get_result(timeout=0.1) is None      # nothing leaked to the shared queue
    manager.stop()
    manager.destroy()


def test_get_result_with_id_requeues_other_results(tiny_llama):
    model, _ = tiny_llama
    manager = make_manager(model, max_new_tokens=3)
    manager.start()
    first = manager.add_request([3, 4], request_id="first")
    manager.stop()                                    # both done, both queued
    assert first == "first"
    manager.start()
    manager.add_request([5, 6], request_id="second")
    manager.stop()
    assert manager.get_result(request_id="second") is None     # head "first" goes to the back
    assert manager.get_result(request_id="second").request_id == "second"
    assert manager.get_result(request_id="first").request_id == "first"
    assert manager.get_result() is None
    manager.destroy()


def test_bad_requests_get_typed_errors_and_do_not_disturb_others(tiny_llama):
    model, _ = tiny_llama
    manager = make_manager(model, num_blocks=8)      # 32 tokens of cache
    manager.start()
    good = manager.add_request([3, 4, 5])
    with pytest.raises(RequestTooLongError):
        manager.add_request(list(range(3, 30)), max_new_tokens=10)
    with pytest.raises(InvalidRequestError):
        manager.add_request([])
    with pytest.raises(InvalidRequestError):
        manager.add_request([10**9])
    with pytest.raises(InvalidRequestError):
        manager.add_request([3], max_new_tokens=0)
    with pytest.raises(InvalidRequestError):
        manager.add_request([3], top_p=2.0)
    with pytest.raises(InvalidRequestError):
        manager.add_request([3], not_a_parameter=1)
    assert collect(manager, [good])[good].status is RequestStatus.FINISHED
    manager.stop()
    manager.destroy()


def test_queue_limit_raises_queue_full(tiny_llama):
    """max_queue_size counts the requests beyond what the engine can admit now: two
    batch slots take the first two, the queue the next two, the fifth is refused."""
    model, _ = tiny_llama
    manager = make_manager(model, max_queue_size=2, max_requests_per_batch=2)
    with manager.pause():                       # not started: nothing drains the queue
        for token in (3, 4, 5, 6):
            manager.add_request([token])
        with pytest.raises(QueueFullError):
            manager.add_request([7])
    manager.destroy()


def test_requests_queued_before_start_are_served(tiny_llama):
    model, reference = tiny_llama
    manager = make_manager(model, max_new_tokens=3)
    rid = manager.add_request([7, 8, 9])                 # not started yet: queued
    assert rid is not None
    manager.start()
    results = list(manager.request_id_iter(rid))
    assert results[-1].generated_tokens == reference_greedy(reference, [7, 8, 9], 3)
    manager.stop()
    manager.destroy()


def test_request_id_iter_ends_after_stop_when_none_of_its_results_are_left(tiny_llama):
    """After the thread stops, iterating an id whose results are gone (consumed, unknown)
    ends after one pass over the queue, though other requests' results stay queued."""
    model, _ = tiny_llama
    manager = make_manager(model, max_new_tokens=2)
    manager.start()
    first, second = manager.add_request([3, 4]), manager.add_request([5, 6])
    manager.stop(block=True)
    assert list(manager.request_id_iter(first))[-1].is_finished()
    leftovers: list = []

    def iterate_both():
        leftovers.extend(r.request_id for r in manager.request_id_iter(first))
        leftovers.extend(r.request_id for r in manager.request_id_iter("never-added"))

    iterating = threading.Thread(target=iterate_both, daemon=True)
    iterating.start()
    iterating.join(timeout=10)
    assert not iterating.is_alive() and leftovers == []
    assert manager.get_result(second).request_id == second    # still there, not lost
    waited = time.monotonic()
    assert manager.get_result(timeout=30) is None     # stopped: nothing more can come
    assert time.monotonic() - waited < 5
    manager.destroy()
    assert model.generate_batch([]) == {}


def test_a_batch_larger_than_the_queue_limit_goes_through(tiny_llama):
    """add_requests (and so generate_batch) waits for room under max_queue_size; a
    single add_request over the limit is refused at once (test_queue_limit_raises_queue_full)."""
    model, _ = tiny_llama
    prompts = random_prompts(6, 2, 10, seed=4)
    outputs = model.generate_batch(
        prompts, GenerationConfig(max_new_tokens=3, eos_token_id=[]),
        ContinuousBatchingConfig(page_size=4, num_blocks=64, max_queue_size=2), warmup=False)
    assert [len(o.generated_tokens) for o in outputs.values()] == [3] * 6


def test_a_failing_batch_does_not_run_the_rest_of_its_requests(tiny_llama):
    """A bad prompt in generate_batch raises, and the requests queued before it are
    failed at once, not generated to their end first."""
    model, _ = tiny_llama
    prompts = random_prompts(3, 4, 8, seed=6) + [[-1]]
    with pytest.raises(InvalidRequestError):
        model.generate_batch(prompts, GenerationConfig(max_new_tokens=500, eos_token_id=[]),
                             ContinuousBatchingConfig(page_size=16, num_blocks=256,
                                                      allow_block_sharing=False),
                             warmup=False, persistent_manager=True)
    manager = model.kept_manager
    results = []
    while (result := manager.get_result()) is not None:
        results.append(result)
    manager.destroy()
    finished = [r for r in results if r.is_finished()]
    assert len(finished) == 3 and all(r.status is RequestStatus.FAILED for r in finished)


def test_context_manager_and_persistent_manager(tiny_llama):
    model, _ = tiny_llama
    with model.continuous_batching_context_manager(
            GenerationConfig(max_new_tokens=4, eos_token_id=[]),
            continuous_batching_config=ContinuousBatchingConfig(page_size=4, num_blocks=32),
            persistent_manager=True) as manager:
        rid = manager.add_request([3, 4, 5])
        result = next(r for r in manager.request_id_iter(rid) if r.is_finished())
        assert len(result.generated_tokens) == 4
    assert not manager.is_running()
    assert model.init_continuous_batching() is manager     # kept for the next session
    manager.destroy()
    assert model.kept_manager is None


def test_entry_points_take_transformers_parameters_in_its_order(tiny_llama):
    """The model's entry points and the manager's methods have the parameters of
    transformers' ContinuousMixin / ContinuousBatchingManager, in the same order (so
    positional calls mean the same), with the same defaults where transformers has
    one (ours may default more: `join()` needs no stop time)."""
    import inspect

    from transformers.generation.continuous_batching import continuous_api

    model, _ = tiny_llama
    manager = make_manager(model)
    pairs = [(model.continuous_batching_context_manager,
              continuous_api.ContinuousMixin.continuous_batching_context_manager),
             (model.generate_batch, continuous_api.ContinuousMixin.generate_batch)]
    pairs += [(getattr(manager, name), getattr(continuous_api.ContinuousBatchingManager, name))
              for name in ("add_request", "add_requests", "get_result", "stop", "join")]
    for ours, theirs in pairs:
        def parameters(function, skip_self):
            listed = list(inspect.signature(function).parameters.values())[skip_self:]
            return [(p.name, p.default) for p in listed if p.kind is not p.VAR_KEYWORD]
        mine, wanted = parameters(ours, 0), parameters(theirs, 1)
        assert [name for name, _ in mine] == [name for name, _ in wanted], ours.__name__
        assert all(default == want for (_, default), (_, want) in zip(mine, wanted)
                   if want is not inspect.Parameter.empty), ours.__name__
    manager.destroy()


def test_a_reused_manager_is_warmed_up_once(tiny_llama):
    model, _ = tiny_llama
    config = ContinuousBatchingConfig(page_size=4, num_blocks=32)
    generation = GenerationConfig(max_new_tokens=2, eos_token_id=[])
    model.generate_batch([[3, 4]], generation, config, persistent_manager=True)
    manager = model.kept_manager
    assert manager.warmed_up
    runs = []
    warmup = manager.loop.warmup
    manager.loop.warmup = lambda: (runs.append(1), warmup())
    outputs = model.generate_batch([[5, 6]], persistent_manager=True)   # the cached manager
    assert model.kept_manager is manager and runs == []
    assert len(list(outputs.values())[0].generated_tokens) == 2
    manager.warmup()                                        # asked for: it runs
    assert runs == [1]
    manager.destroy()


def test_eos_stops_and_stays_last(tiny_llama):
    model, reference = tiny_llama
    prompt = [7, 8, 9, 10]
    greedy = reference_greedy(reference, prompt, 6)
    eos = greedy[2]
    manager = model.init_continuous_batching(
        GenerationConfig(max_new_tokens=6, eos_token_id=eos),
        ContinuousBatchingConfig(page_size=4, num_blocks=16))
    manager.start()
    rid = manager.add_request(prompt)
    result = collect(manager, [rid])[rid]
    assert result.generated_tokens == greedy[:greedy.index(eos) + 1]
    assert result.finish_reason == "stop"
    rid = manager.add_request(prompt, eos_token_id=[])      # EOS disabled per request
    assert collect(manager, [rid])[rid].generated_tokens == greedy
    manager.stop()
    manager.destroy()
