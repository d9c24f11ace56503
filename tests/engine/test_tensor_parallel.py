"""Tensor parallelism on CPU: two torchrun ranks over gloo, each holding half of every
layer's heads and MLP columns, give the single-process tokens and log-probabilities
(and transformers' greedy tokens) for every family and scheduling path; the manager's
streaming, cancellation and stop work with requests on the driver rank only."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from engine import ContinuousBatchingConfig, GenerationConfig, load_model
from engine.distributed import TensorParallelError
from tests.engine.tp_worker import MAX_NEW_TOKENS, SCENARIOS, scenario_prompts
from tests.helpers import TINY_FAMILIES, random_prompts, reference_greedy

WORKER = Path(__file__).with_name("tp_worker.py")


@pytest.fixture(scope="module")
def tp_reports(tiny_models, tmp_path_factory):
    """rank -> what that rank's worker saw, from one `torchrun --nproc-per-node 2`."""
    out_dir = tmp_path_factory.mktemp("tp-run")
    torchrun = Path(sys.executable).with_name("torchrun")
    models = [f"{family}={tiny_models[family][0]}" for family in TINY_FAMILIES]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    completed = subprocess.run(
        [str(torchrun), "--standalone", "--nproc-per-node", "2", str(WORKER), str(out_dir),
         *models], capture_output=True, text=True, timeout=300, env=env)
    assert completed.returncode == 0, completed.stderr[-4000:]
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in (0, 1)]


def single_process_run(path, name: str):
    model = load_model(path, progress=False)
    outputs = model.generate_batch(
        scenario_prompts(name), GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, eos_token_id=[]),
        ContinuousBatchingConfig(**SCENARIOS[name]))
    return [o.generated_tokens for o in outputs.values()], [o.logprobs for o in outputs.values()]


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_two_ranks_give_the_single_process_tokens_and_logprobs(tp_reports, tiny_models, family):
    path, reference = tiny_models[family]
    driver, follower = (report[family]["generate_batch"] for report in tp_reports)
    for name in SCENARIOS:
        tokens, logprobs = single_process_run(path, name)
        assert driver[name]["tokens"] == tokens, name
        assert follower[name]["tokens"] == tokens, name    # every rank returns the outputs
        expected = [reference_greedy(reference, p, MAX_NEW_TOKENS) for p in scenario_prompts(name)]
        assert tokens == expected, name
        if SCENARIOS[name].get("return_logprobs"):
            for sharded, whole in zip(driver[name]["logprobs"], logprobs):
                assert sharded == pytest.approx(whole, abs=1e-4)


def test_each_rank_caches_only_its_heads_and_follows_the_driver_schedule(tp_reports):
    for family in TINY_FAMILIES:
        driver, follower = (report[family] for report in tp_reports)
        assert driver["num_kv_heads"] == follower["num_kv_heads"] == 1     # 2 KV heads / 2 ranks
        offload = driver["generate_batch"]["offload"]["stats"]
        assert offload["num_preemptions"] > 0
        assert offload["num_swapped_in"] == offload["num_swapped_out"] == offload["num_preemptions"]
        assert driver["generate_batch"]["prefix"]["stats"]["prefix_cache_hits"] > 0
        for name in SCENARIOS:       # both ranks sized the same cache
            assert (driver["generate_batch"][name]["stats"]["num_blocks"]
                    == follower["generate_batch"][name]["stats"]["num_blocks"])


def test_manager_streams_on_the_driver_while_followers_only_compute(tp_reports, tiny_models):
    for family in TINY_FAMILIES:
        driver, follower = (report[family]["manager"] for report in tp_reports)
        prompt = random_prompts(2, 6, 12, seed=8)[0]
        expected = reference_greedy(tiny_models[family][1], prompt, MAX_NEW_TOKENS)
        assert driver["is_driver"] and not follower["is_driver"]
        assert driver["stream_lengths"] == list(range(1, MAX_NEW_TOKENS + 1))
        assert driver["streamed_tokens"] == expected
        assert driver["ids"] == ["streamed", "cancelled"]
        assert follower["ids"] == [None, None]          # only the driver queues requests
        assert follower["result_on_follower"] is None
        assert driver["stopped"] and follower["stopped"]


def test_tp_size_must_divide_the_kv_heads(tiny_models):
    path = tiny_models["llama"][0]          # 2 KV heads
    with pytest.raises(TensorParallelError, match="num_key_value_heads"):
        load_model(path, progress=False, tp_size=4)
    with pytest.raises(ValueError, match="tp_size"):
        load_model(path, progress=False, tp_size=0)


def test_tp_needs_a_torchrun_launch(tiny_models, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(TensorParallelError, match="torchrun --nproc-per-node 2"):
        load_model(tiny_models["llama"][0], progress=False, tp_size=2)
