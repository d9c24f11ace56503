"""The machine's own limits, measured in the same run as a benchmark so throughput can
be shown as a fraction of them: memory read and copy bandwidth and matmul speed at the
model's shapes, per dtype; and, for reference, int8 x int8 -> int32 products (oneDNN's
VNNI kernels through `torch._int_mm`), the compute ceiling a W8A8 path would have.

    python -m bench.machine --read            # read bandwidth, 1 GiB by 2 threads
    python -m bench.machine                   # everything, at the default model's shapes

The read bandwidth bounds a decode step at one request: a token reads every weight
once, so a model whose tensors hold B bytes runs at most read_bandwidth / B tokens a
second (`read_bound_ms`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch


def _best_seconds(fn, repeats: int = 5) -> float:
    fn()                                   # warm up caches and thread pools
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def median_seconds(fn, repeats: int) -> float:
    """Median time of `repeats` calls of fn, after one warm-up call (the kernel
    benchmarks': a median, as streaming from memory varies more than a best)."""
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def copy_bandwidth_gbs(megabytes: int = 128) -> float:
    """Read + write bandwidth of a large tensor copy, GB/s (bytes moved / time)."""
    source = torch.ones(megabytes * 2**20 // 4)
    target = torch.empty_like(source)
    seconds = _best_seconds(lambda: target.copy_(source))
    return 2 * source.numel() * 4 / seconds / 1e9


def read_bandwidth_gbs(megabytes: int = 1024, threads: int = 2) -> float:
    """Read bandwidth, GB/s: a buffer far larger than the caches summed by `threads`
    threads (torch's reduction streams it once), the median of 7 passes."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        buffer = torch.ones(megabytes * 2**20 // 4)
        seconds = median_seconds(lambda: buffer.sum(), repeats=7)
    finally:
        torch.set_num_threads(previous)
    return buffer.numel() * 4 / seconds / 1e9


def read_bound_ms(tensor_bytes: int, bandwidth_gbs: float) -> float:
    """The fastest one-request decode step a model of `tensor_bytes` allows, ms: its
    weights read once at `bandwidth_gbs`."""
    return tensor_bytes / (bandwidth_gbs * 1e9) * 1e3


def matmul_gflops(m: int, k: int, n: int, dtype: torch.dtype) -> float:
    """GFLOP/s of x[m, k] @ w[n, k].T, the shape of a linear layer on m tokens."""
    x = torch.randn(m, k).to(dtype)
    w = torch.randn(n, k).to(dtype)
    reps = max(1, int(2e8 // (2 * m * k * n)))  # about 0.2 GFLOP of work per timing

    def run():
        for _ in range(reps):
            torch.nn.functional.linear(x, w)

    return 2 * m * k * n * reps / _best_seconds(run) / 1e9


def int8_matmul_gops(m: int, k: int, n: int) -> float | None:
    """Giga-ops/s (2 per multiply-add) of int8 x[m, k] @ w[k, n] with int32 sums, or
    None where this torch has no CPU int8 matmul."""
    x = torch.randint(-127, 128, (m, k), dtype=torch.int8)
    w = torch.randint(-127, 128, (k, n), dtype=torch.int8)
    reps = max(1, int(2e8 // (2 * m * k * n)))

    def run():
        for _ in range(reps):
            torch._int_mm(x, w)

    try:
        return 2 * m * k * n * reps / _best_seconds(run) / 1e9
    except (RuntimeError, AttributeError):
        return None


def measure(hidden_size: int, intermediate_size: int) -> dict:
    """Bandwidth and matmul speed at a decode-like (m=1) and a batched (m=64) shape."""
    limits = {"read_bandwidth_gbs": round(read_bandwidth_gbs(), 1),
              "copy_bandwidth_gbs": round(copy_bandwidth_gbs(), 1),
              "threads": torch.get_num_threads()}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for m in (1, 64):
            limits[f"matmul_{name}_m{m}_gflops"] = round(
                matmul_gflops(m, hidden_size, 2 * intermediate_size, dtype), 1)
    int8 = int8_matmul_gops(64, hidden_size, 2 * intermediate_size)
    if int8 is not None:
        limits["matmul_int8_m64_gops"] = round(int8, 1)
    return limits


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--read", action="store_true", help="only the read bandwidth")
    parser.add_argument("--megabytes", type=int, default=1024, help="the read buffer's size")
    parser.add_argument("--threads", type=int, default=2, help="threads reading it")
    parser.add_argument("--model-bytes", type=int, default=0,
                        help="a model's tensor bytes: also print its read bound (ms a token)")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--intermediate", type=int, default=1536)
    args = parser.parse_args(argv)
    bandwidth = read_bandwidth_gbs(args.megabytes, args.threads)
    result = {"read_bandwidth_gbs": round(bandwidth, 1), "read_threads": args.threads}
    if args.model_bytes:
        result["read_bound_ms"] = round(read_bound_ms(args.model_bytes, bandwidth), 1)
    if not args.read:
        result.update(measure(args.hidden, args.intermediate))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
