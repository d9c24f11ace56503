"""Where a generate_batch run's time goes, by torch's profiler: the host's ops and
runtime calls by their own time, the device's kernels by theirs, and the wall time per
engine step, for one warm run of bench.offline's workload.

    python -m bench.profile --model /tmp/model --device cuda --num-prompts 1 --cuda-graph on

The host table says what a step waits on (cudaStreamSynchronize, cudaEventSynchronize,
copies to the host) and what the engine thread spends between launches; the device
table, how long the launched work itself runs. A step whose wall time is far above its
device time is bound by the host. Prints plain text; --trace writes a Chrome trace.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine import ContinuousBatchingConfig, GenerationConfig, load_model

from .offline import make_prompts


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.profile", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--num-prompts", type=int, default=1)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--cuda-graph", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--async-batching", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--rows", type=int, default=25, help="rows of each table")
    parser.add_argument("--trace", default=None, help="write a Chrome trace here")
    return parser.parse_args(argv)


def switch(value: str) -> bool | None:
    return None if value == "auto" else value == "on"


def all_threads_config():
    """Kineto's settings for the engine's own thread (the manager steps there, not on
    the caller's), with CUDA synchronizations as events; None where torch has neither."""
    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True,
                                                      enable_cuda_sync_events=True)
    except (AttributeError, TypeError):
        return None


def main(argv=None) -> None:
    args = parse_args(argv)
    model = load_model(args.model, dtype=args.dtype, device=args.device, progress=False)
    prompts = make_prompts(args.num_prompts, args.input_len, model.config.vocab_size, 0)
    config = ContinuousBatchingConfig(use_cuda_graph=switch(args.cuda_graph),
                                      use_async_batching=switch(args.async_batching))
    generation = GenerationConfig(max_new_tokens=args.output_len, eos_token_id=[])
    model.generate_batch(prompts, generation, config)            # records graphs, warms up
    activities = [ProfilerActivity.CPU]
    if model.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    with profile(activities=activities, experimental_config=all_threads_config()) as profiler:
        started = time.perf_counter()
        model.generate_batch(prompts, generation, config, warmup=False,
                             persistent_manager=True)
        seconds = time.perf_counter() - started
    stats = model.kept_manager.stats()
    model.kept_manager.destroy()
    steps = max(1, stats.get("num_steps", 1))
    print(f"{seconds:.3f} s for {steps} steps: {1000 * seconds / steps:.2f} ms a step; "
          f"engine {stats}")
    averages = profiler.key_averages()
    print(averages.table(sort_by="self_cpu_time_total", row_limit=args.rows))
    if model.device.type == "cuda":
        print(averages.table(sort_by="self_device_time_total", row_limit=args.rows))
        device_us = sum(event.self_device_time_total for event in averages)
        print(f"device time {device_us / 1000:.1f} ms in all, "
              f"{device_us / 1000 / steps:.3f} ms a step")
    if args.trace:
        profiler.export_chrome_trace(args.trace)


if __name__ == "__main__":
    main()
