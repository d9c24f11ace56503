"""Lifecycle edge cases: no request is ever accepted and then left unanswered, and no
caller mistake hangs or kills the engine."""

import threading

import pytest

from engine import ContinuousBatchingConfig, GenerationConfig, RequestStatus
from engine.errors import InvalidRequestError


def make_manager(model, max_new_tokens=4):
    return model.init_continuous_batching(
        GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=[]),
        ContinuousBatchingConfig(page_size=4, num_blocks=32))


def test_engine_crash_fails_held_requests_and_refuses_new_ones(tiny_llama):
    model, _ = tiny_llama
    manager = make_manager(model)

    def broken_step(batch, inputs=None):
        raise RuntimeError("injected fault")

    manager.loop.runner.launch = broken_step     # the next forward pass raises
    manager.start()
    first = manager.add_request([3, 4, 5])
    result = next(manager.request_id_iter(first))
    assert result.status is RequestStatus.FAILED and "injected fault" in result.error
    manager.join(timeout=10)
    assert not manager.is_running()
    assert isinstance(manager.error, RuntimeError) and "injected fault" in str(manager.error)
    assert manager.add_request([6, 7]) is None   # refused, not silently queued
    del manager.loop.runner.launch               # the real step again
    manager.start()                              # a restart clears the error
    assert manager.error is None
    restarted = manager.add_request([6, 7], max_new_tokens=2)
    assert list(manager.request_id_iter(restarted))[-1].status is RequestStatus.FINISHED
    manager.stop()
    manager.destroy()


def test_a_raising_result_handler_does_not_kill_the_engine(tiny_llama):
    model, _ = tiny_llama
    manager = make_manager(model)
    manager.start()

    def buggy(output):
        raise ValueError("caller bug")

    manager.register_result_handler("buggy", buggy)   # no event loop: runs on the engine thread
    manager.add_request([3, 4, 5], request_id="buggy")
    other = manager.add_request([6, 7, 8])
    result = [r for r in manager.request_id_iter(other)][-1]
    assert result.status is RequestStatus.FINISHED and len(result.generated_tokens) == 4
    assert manager.is_running()
    manager.stop()
    manager.destroy()


def test_stop_inside_pause_does_not_hang(tiny_llama):
    model, _ = tiny_llama
    manager = make_manager(model)
    manager.start()
    rid = manager.add_request([3, 4, 5])
    done = threading.Event()

    def pause_then_stop():
        with manager.pause():
            manager.stop(block=True)            # must return although the loop is paused
            with pytest.raises(RuntimeError):
                manager.destroy()
        done.set()

    thread = threading.Thread(target=pause_then_stop)
    thread.start()
    assert done.wait(30)
    manager.join(timeout=30)
    assert not manager.is_running()
    assert manager.get_result(rid).status is RequestStatus.FINISHED   # it still finished
    manager.destroy()


def test_start_right_after_a_non_blocking_stop(tiny_llama):
    model, _ = tiny_llama
    manager = make_manager(model)
    manager.start()
    manager.stop(block=False)
    manager.start()                              # waits for the old thread, starts anew
    rid = manager.add_request([3, 4, 5])
    assert rid is not None
    assert [r for r in manager.request_id_iter(rid)][-1].status is RequestStatus.FINISHED
    manager.stop()
    manager.destroy()


def test_request_ids_in_flight_are_unique(tiny_llama):
    model, _ = tiny_llama
    manager = make_manager(model, max_new_tokens=50)
    with manager.pause():
        manager._accepting = True                # not started: both stay queued
        manager.add_request([3, 4], request_id="same")
        with pytest.raises(InvalidRequestError, match="already in use"):
            manager.add_request([5, 6], request_id="same")
    manager.start()
    assert [r for r in manager.request_id_iter("same")][-1].is_finished()
    assert manager.add_request([7, 8], request_id="same") == "same"   # free again once done
    manager.stop()
    manager.destroy()


def test_generation_config_json_supplies_eos_ids(tiny_models, tmp_path):
    import shutil

    from transformers import GenerationConfig as HFGenerationConfig

    from engine import load_model

    path, _ = tiny_models["llama"]
    copy = tmp_path / "model"
    shutil.copytree(path, copy)
    HFGenerationConfig(eos_token_id=[2, 7]).save_pretrained(copy)
    assert load_model(copy, progress=False).generation_config.eos_token_id == [2, 7]
