"""One rank of the tensor-parallel tests; started by test_tensor_parallel.py as

    torchrun --nproc-per-node 2 tests/engine/tp_worker.py OUT_DIR FAMILY=MODEL_DIR ...

Every rank runs the same scenarios, as a user's script would, and writes what it saw
to OUT_DIR/rank<R>.json; the test compares those with single-process runs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch.distributed as dist  # noqa: E402

from engine import ContinuousBatchingConfig, GenerationConfig, load_model  # noqa: E402
from tests.helpers import random_prompts  # noqa: E402

MAX_NEW_TOKENS = 10
SCENARIOS = {
    # name -> ContinuousBatchingConfig fields; the test runs the same in one process
    "default": dict(return_logprobs=True),
    "chunked": dict(page_size=4, max_batch_tokens=16, scheduler_type="prefill_first"),
    "offload": dict(page_size=4, max_batch_tokens=64, num_blocks=12, cpu_offload_space=0.01,
                    allow_block_sharing=False),
    "prefix": dict(page_size=4, allow_block_sharing=True),
}


def scenario_prompts(name: str) -> list[list[int]]:
    if name == "prefix":        # four prompts sharing a 12-token start
        shared = random_prompts(1, 12, 12, seed=5)[0]
        return [shared + tail for tail in random_prompts(4, 3, 9, seed=6)]
    return random_prompts(8, 5, 30, seed=21)


def run_generate_batch(model) -> dict:
    seen = {}
    for name, fields in SCENARIOS.items():
        outputs = model.generate_batch(
            scenario_prompts(name), GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, eos_token_id=[]),
            ContinuousBatchingConfig(**fields), persistent_manager=True, warmup=True)
        manager = model.kept_manager
        stats = manager.stats()
        manager.destroy()
        seen[name] = {"tokens": [o.generated_tokens for o in outputs.values()],
                      "logprobs": [o.logprobs for o in outputs.values()],
                      "stats": stats}
    return seen


def run_manager_api(model) -> dict:
    """Streaming, cancellation and stop through the manager on every rank."""
    prompts = random_prompts(2, 6, 12, seed=8)
    manager = model.init_continuous_batching(
        GenerationConfig(max_new_tokens=MAX_NEW_TOKENS, eos_token_id=[]))
    manager.start()
    streamed_id = manager.add_request(prompts[0], request_id="streamed", streaming=True)
    cancelled_id = manager.add_request(prompts[1], request_id="cancelled", max_new_tokens=400)
    seen: dict = {"is_driver": manager.is_driver, "ids": [streamed_id, cancelled_id]}
    if manager.is_driver:
        partials = [r.generated_tokens for r in manager.request_id_iter("streamed")]
        seen["stream_lengths"] = [len(p) for p in partials]
        seen["streamed_tokens"] = partials[-1]
        manager.cancel_request("cancelled")
    else:
        seen["result_on_follower"] = manager.get_result(timeout=0.1)
    manager.stop(block=True)
    seen["stopped"] = not manager.is_running()
    manager.destroy()
    return seen


def main() -> None:
    out_dir = Path(sys.argv[1])
    report = {}
    for item in sys.argv[2:]:
        family, path = item.split("=", 1)
        model = load_model(path, progress=False, tp_size=2)
        report[family] = {
            "num_kv_heads": model.module.num_kv_heads,
            "generate_batch": run_generate_batch(model),
            "manager": run_manager_api(model),
        }
    rank = dist.get_rank()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
