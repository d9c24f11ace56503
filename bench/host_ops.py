"""What the host pays per torch call on this machine: the floor under a step's time
when the device's work is small (a decode step of a small model is a few hundred
calls eagerly, a few dozen around a CUDA graph's replay).

    python -m bench.host_ops --device cuda

Each figure is the median over rounds of `--calls` calls, in microseconds per call:
a pure-Python loop of 1,000 additions (the interpreter's speed, to compare hosts), a
host tensor from a list (how step inputs start), an in-place add on the device (one
kernel launch), a host-to-device copy without waiting, an event recorded and waited
for, a pinned host buffer, and (on CUDA) the replay of a recorded graph of 100 adds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def per_call_us(function, calls: int, rounds: int = 5) -> float:
    function()                                         # first call: lazy set-up
    timings = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            function()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        timings.append((time.perf_counter() - started) / calls * 1e6)
    return round(statistics.median(timings), 2)


def measure(device: torch.device, calls: int) -> dict[str, float]:
    values = list(range(64))
    small = torch.zeros(64, device=device)
    host = torch.zeros(64, dtype=torch.long)
    results = {
        "python_1000_adds": per_call_us(lambda: sum(range(1000)), max(1, calls // 10)),
        "host_tensor_from_list": per_call_us(lambda: torch.tensor(values), calls),
        "device_add_": per_call_us(lambda: small.add_(1.0), calls),
        "copy_to_device": per_call_us(lambda: host.to(device, non_blocking=True), calls),
    }
    if device.type == "cuda":
        def event_round_trip():
            event = torch.cuda.Event()
            event.record()
            event.synchronize()

        results["event_record_and_wait"] = per_call_us(event_round_trip, calls)
        results["pinned_buffer"] = per_call_us(
            lambda: torch.empty(64, dtype=torch.long, pin_memory=True), calls)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            small.add_(1.0)                            # warm up off the default stream
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            for _ in range(100):
                small.add_(1.0)
        results["graph_replay_100_adds"] = per_call_us(graph.replay, max(1, calls // 10))
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.host_ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args(argv)
    results = {"device": args.device, "torch_threads": torch.get_num_threads(),
               **measure(torch.device(args.device), args.calls)}
    print(json.dumps(results))
    return results


if __name__ == "__main__":
    main()
