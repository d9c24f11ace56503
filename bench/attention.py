"""Decode attention alone: the native kernel over one cache per layer, as a decode
step reads them, for B requests of C context tokens each.

    python -m bench.attention --batch 1,8,32 --context 1000,4000 --json attention.json
    python -m bench.attention --batch 21 --context 98 --chunk-rows 98 --cache-dtype bfloat16

With `--chunk-rows N` each request is a prefill chunk of N rows instead of one decode
row: its queries at positions C - N .. C - 1, each over its causal context, the way a
mixed step's short chunks reach the kernel (one call per layer, `slot_rows`).

Each layer has its own K and V arrays (default 30 layers, 9 query heads on 3 KV heads
of 64: the default model), so a step's K/V come from memory, not from the CPU's
caches, as they do when serving. It reports the time of the step's attention (every
layer once) and the bytes it read per second, beside this machine's copy bandwidth
measured in the same run: the bound of attention over long contexts. Run it from two
checkouts, alternating, to compare kernel versions side by side.
"""

from __future__ import annotations

import argparse

import torch

from engine.kernels import load_native_kernels

from .machine import copy_bandwidth_gbs, median_seconds
from .report import write_json


def time_attention(kernels, batch: int, context: int, layers: int, heads: int,
                   kv_heads: int, dim: int, dtype: torch.dtype, repeats: int,
                   chunk_rows: int = 1) -> float:
    """Median seconds of `layers` kernel calls, one per layer's cache; each request
    a chunk of `chunk_rows` query rows ending at its context's last position."""
    generator = torch.Generator().manual_seed(batch * 7919 + context)
    slots = batch * context
    caches = [(torch.randn(slots, kv_heads, dim, generator=generator).to(dtype),
               torch.randn(slots, kv_heads, dim, generator=generator).to(dtype))
              for _ in range(layers)]
    query = torch.randn(batch * chunk_rows, heads, dim, generator=generator)
    slots_of = torch.arange(slots).view(batch, context)       # pages in order, as allocated
    # row r of request b sees context - chunk_rows + 1 + r keys of slots row b
    lengths = (context - chunk_rows + 1 + torch.arange(chunk_rows)).repeat(batch)
    slot_rows = torch.arange(batch).repeat_interleave(chunk_rows) if chunk_rows > 1 else None

    def step() -> None:
        for keys, values in caches:
            kernels.paged_decode_attention(query, keys, values, slots_of, lengths, dim ** -0.5,
                                           slot_rows=slot_rows)

    return median_seconds(step, repeats)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.attention", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,8,32", help="comma-separated batch sizes")
    parser.add_argument("--context", default="1000", help="comma-separated context lengths")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--cache-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--chunk-rows", type=int, default=1,
                        help="query rows per request: 1 (decode) or a prefill chunk's")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if not 1 <= args.chunk_rows <= min(int(c) for c in args.context.split(",")):
        parser.error("--chunk-rows must be between 1 and the shortest --context")
    kernels = load_native_kernels()
    if kernels is None:
        raise SystemExit("the native kernels are not built here (no C compiler?)")
    dtype = getattr(torch, args.cache_dtype)
    bandwidth = copy_bandwidth_gbs()
    rows = []
    for context in (int(c) for c in args.context.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            seconds = time_attention(kernels, batch, context, args.layers, args.heads,
                                     args.kv_heads, args.head_dim, dtype, args.repeats,
                                     args.chunk_rows)
            read = 2 * batch * context * args.kv_heads * args.head_dim * dtype.itemsize \
                * args.layers
            rows.append({"batch": batch, "context": context, "step_ms": round(seconds * 1e3, 3),
                         "kv_mb": round(read / 1e6, 3), "read_gbs": round(read / seconds / 1e9, 3)})
            print(f"batch {batch:4d}  context {context:6d}  attention {seconds * 1e3:8.2f} ms  "
                  f"K/V {read / 1e6:7.1f} MB at {read / seconds / 1e9:5.1f} GB/s "
                  f"(copy bandwidth {bandwidth:.1f} GB/s)")
    report = {"layers": args.layers, "heads": args.heads, "kv_heads": args.kv_heads,
              "chunk_rows": args.chunk_rows,
              "head_dim": args.head_dim, "cache_dtype": args.cache_dtype,
              "vector_path": kernels.vector_attention(args.head_dim),
              "copy_bandwidth_gbs": bandwidth, "steps": rows}
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
