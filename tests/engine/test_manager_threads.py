"""Several caller threads adding and cancelling at once while the engine runs: every
request that was not cancelled finishes with all its tokens, a cancelled one either
finished before its cancellation or delivers nothing, and no block leaks."""

import random
import threading
import time

from engine import ContinuousBatchingConfig, GenerationConfig, RequestStatus


def test_concurrent_callers_add_and_cancel(tiny_llama):
    model, _ = tiny_llama
    manager = model.init_continuous_batching(
        GenerationConfig(max_new_tokens=12, eos_token_id=[]),
        ContinuousBatchingConfig(page_size=4, num_blocks=40, max_batch_tokens=32))
    manager.start()
    cancelled, added, lock = set(), [], threading.Lock()

    def caller(seed: int) -> None:
        rng = random.Random(seed)
        for index in range(15):
            request_id = manager.add_request(
                [rng.randrange(3, 200) for _ in range(rng.randint(1, 20))],
                request_id=f"t{seed}-{index}", do_sample=bool(index % 2), seed=index)
            with lock:
                added.append(request_id)
            if rng.random() < 0.3:
                time.sleep(rng.random() * 0.01)
                manager.cancel_request(request_id)
                with lock:
                    cancelled.add(request_id)

    threads = [threading.Thread(target=caller, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    manager.stop(block=True, timeout=120)
    assert not manager.is_running()
    results = {}
    while (result := manager.get_result()) is not None:
        results[result.request_id] = result
    expected = set(added) - cancelled
    assert expected <= set(results)                        # nothing lost
    for request_id in expected:
        assert results[request_id].status is RequestStatus.FINISHED
        assert len(results[request_id].generated_tokens) == 12
    assert all(r.status is RequestStatus.FINISHED and len(r.generated_tokens) == 12
               for r in results.values())                 # no partial result escapes
    assert len(added) == 60 and cancelled
    manager.check_invariants()
    stats = manager.stats()
    assert stats["num_free_blocks"] == stats["num_blocks"] and stats["num_running"] == 0
    manager.destroy()
