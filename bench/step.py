"""Decode-step latency: one forward pass of B requests that each feed one token
after a context of C tokens, through the engine's own runner (paged cache, sampling
included), timed on a worker thread as the engine thread runs it.

    python -m bench.step --batch 1,8,32 --context 100,1000 --json step.json

It isolates what a decode step costs (the inter-token latency floor at concurrency
B) from prefill and HTTP, and shows each step against this machine's limits measured
in the same run (bench/bounds.py): the time to read the step's weight bytes at the
copy bandwidth (the bound of small steps) and its matmul GFLOP/s against torch's
at 64 rows in the dtype large steps multiply in (the bound of large ones). Run it twice, with KVSERVE_NATIVE_KERNELS=0 the second
time, to compare the native kernels with torch's ops side by side; `--compare-loop`
times each step a second time through the per-layer loop, without the whole-stack
native calls (models/packed_stack.py, fast_decode.py).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import threading
import time

import torch

from engine import load_model
from engine.kernels.cpu_threads import release_openmp_pool
from engine.generation_config import SamplingParams
from engine.kv_cache.allocator import BlockAllocator
from engine.kv_cache.sizing import CacheSizing
from engine.core.requests import RequestState
from engine.step.runner import ModelRunner
from engine.core.scheduler import ScheduledBatch, ScheduledRequest, blocks_needed

from .bounds import matmul_flops_per_row, weight_bytes_per_step
from .machine import measure
from .report import write_json

PAGE_SIZE = 16


def decode_batch(runner_blocks: BlockAllocator, batch: int, context: int) -> ScheduledBatch:
    """`batch` requests holding `context` cached tokens, each feeding token `context`."""
    entries = []
    for index in range(batch):
        request = RequestState(f"bench-{index}", [3 + index % 100] * context, 8, (),
                               SamplingParams())
        request.block_ids = runner_blocks.allocate(blocks_needed(context + 1, PAGE_SIZE))
        request.generated_tokens.append(7)
        entries.append(ScheduledRequest(request, context, 1, True))
    return ScheduledBatch(entries, [])


def time_steps(model, batch: int, context: int, repeats: int, executors=None) -> float:
    """Median seconds of one step over `repeats` (after three warm-up steps), on
    `executors` in place of the model's own where given."""
    num_blocks = batch * blocks_needed(context + 1, PAGE_SIZE)
    sizing = CacheSizing(num_blocks, PAGE_SIZE, context + 1, batch, 0)
    runner = ModelRunner(model.module, sizing, seed=0, executors=executors)
    for cache in runner.cache.key_caches + runner.cache.value_caches:
        # written, as serving writes them: untouched pages would all read the kernel's
        # one zero page from the CPU's caches, not the context from memory
        cache.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(0))
    scheduled = decode_batch(BlockAllocator(num_blocks), batch, context)
    times: list[float] = []

    def run() -> None:
        for _ in range(3):
            runner.step(scheduled)
        for _ in range(repeats):
            started = time.perf_counter()
            runner.step(scheduled)
            times.append(time.perf_counter() - started)

    worker = threading.Thread(target=run)
    release_openmp_pool()        # as the manager does before its engine thread starts
    # as the server does after start-up: what exists now stays out of the collector's
    # way while the steps run, or its full collections (~350k objects after a model
    # load) land among the timed steps (~10% of a profile's samples at batch 1)
    gc.collect()
    gc.freeze()
    try:
        worker.start()
        worker.join()
    finally:
        gc.unfreeze()
    runner.cache.release()
    return statistics.median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.step", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="auto", help="as the server's --dtype (auto: its default)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto, float32 or bfloat16 (load_model's kv_cache_dtype)")
    parser.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--context", default="100", help="comma-separated context lengths")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--compare-loop", action="store_true",
                        help="also time each step through the per-layer loop, without the "
                             "model's whole-stack native calls (loop_step_ms)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model = load_model(args.model, dtype=args.dtype, progress=False,
                       kv_cache_dtype=args.kv_cache_dtype)
    native = os.environ.get("KVSERVE_NATIVE_KERNELS", "1") != "0"
    limits = measure(model.config.hidden_size, model.config.intermediate_size)
    dense = "bfloat16" if args.dtype in ("bf16-weights", "bfloat16", "int8-weights") else "float32"
    matmul_rate = limits[f"matmul_{dense}_m64_gflops"]
    rows = []
    for context in (int(c) for c in args.context.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            seconds = time_steps(model, batch, context, args.repeats)
            rows.append(step_row(model.module, batch, context, seconds, limits, matmul_rate))
            row = rows[-1]
            loop = f"  loop {time_loop(model, batch, context, args.repeats, row):8.2f} ms" \
                if args.compare_loop else ""
            print(f"batch {batch:4d}  context {context:6d}  step {seconds * 1e3:8.2f} ms  "
                  f"{batch / seconds:8.1f} tok/s  weights {row['weight_mb']:7.1f} MB "
                  f"({row['bandwidth_fraction']:.0%} of bandwidth)  {row['matmul_gflops']:6.1f} "
                  f"GFLOP/s ({row['matmul_fraction']:.0%} of {dense} matmul){loop}")
    report = {"model": args.model, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
              "native_kernels": native, "machine": limits, "steps": rows}
    write_json(args.json, report)
    return report


def time_loop(model, batch: int, context: int, repeats: int, row: dict) -> float:
    """The same step through the layer loop (the model's whole-stack executors set
    aside), right after the stack's: `row["loop_step_ms"]`, returned too."""
    loop = model.module.executors.without_stacks()
    row["loop_step_ms"] = round(time_steps(model, batch, context, repeats, loop) * 1e3, 2)
    return row["loop_step_ms"]


def step_row(module, batch: int, context: int, seconds: float, limits: dict,
             matmul_rate: float) -> dict:
    """One measured step and its fractions of the machine's limits."""
    weight_bytes = weight_bytes_per_step(module, batch)
    bandwidth_bound = weight_bytes / (limits["copy_bandwidth_gbs"] * 1e9)
    gflops = matmul_flops_per_row(module) * batch / seconds / 1e9
    return {"batch": batch, "context": context, "step_ms": round(seconds * 1e3, 2),
            "tokens_per_s": round(batch / seconds, 1),
            "weight_mb": round(weight_bytes / 1e6, 1),
            "bandwidth_bound_ms": round(bandwidth_bound * 1e3, 2),
            "bandwidth_fraction": _significant(bandwidth_bound / seconds),
            "matmul_gflops": _significant(gflops),
            "matmul_fraction": _significant(gflops / matmul_rate)}


def _significant(value: float) -> float:
    """Three significant digits: a tiny model's fractions stay above zero (a 0.4 MB
    model's 16 ms step is 0.0001 of the matmul rate, which 3 decimals made 0.0)."""
    return float(f"{value:.3g}")


if __name__ == "__main__":
    main()
