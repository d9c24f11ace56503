"""The machine's own limits, measured in the same run as a benchmark so throughput can
be shown as a fraction of them: memory copy bandwidth and matmul speed at the model's
shapes, per dtype; and, for reference, int8 x int8 -> int32 products (oneDNN's VNNI
kernels through `torch._int_mm`), the compute ceiling a W8A8 path would have."""

from __future__ import annotations

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
    limits = {"copy_bandwidth_gbs": round(copy_bandwidth_gbs(), 1), "threads": torch.get_num_threads()}
    for dtype in (torch.float32, torch.bfloat16):
        name = str(dtype).removeprefix("torch.")
        for m in (1, 64):
            limits[f"matmul_{name}_m{m}_gflops"] = round(
                matmul_gflops(m, hidden_size, 2 * intermediate_size, dtype), 1)
    int8 = int8_matmul_gops(64, hidden_size, 2 * intermediate_size)
    if int8 is not None:
        limits["matmul_int8_m64_gops"] = round(int8, 1)
    return limits
