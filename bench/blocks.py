"""The block kernels alone: every projection of a model that runs on GGUF blocks
(`BlockLinear`, the LM head's too when it has blocks), for steps of R rows.

    python -m bench.blocks --rows 1,4,8,16,32 --json blocks.json
    python -m bench.blocks --model MODEL.gguf --dtype int8-activations --rows 1,8,32

For each row count it times one pass over all of them, as a decode step makes it
(the weights stream from memory: a model's blocks far exceed the CPU's caches), and
reports the GFLOP/s and the block bytes read per second, beside this machine's copy
bandwidth measured in the same run. Steps past a projection's `max_rows` would use
its dense weight when serving; here they still take the blocks, to show where the
kernels stop paying. `--dtype int8-activations` times the int8 kernels on the same
blocks repacked (each call quantizes its rows, as serving does). Run it from two checkouts, alternating, to compare kernel
versions side by side.
"""

from __future__ import annotations

import argparse

import torch

from engine import load_model
from engine.models.block_weights import BlockLinear

from .machine import copy_bandwidth_gbs, median_seconds
from .report import write_json


def block_bytes(layer: BlockLinear) -> int:
    """Bytes one pass over `layer`'s blocks reads (codes, scales, minima)."""
    return sum(t.numel() * t.element_size() for part in layer.parts
               for t in (part.codes, part.scales, part.minima) if t is not None)


def time_pass(layers: list[BlockLinear], rows: int, repeats: int) -> float:
    """Median seconds of one kernel call per layer, `rows` activation rows each."""
    generator = torch.Generator().manual_seed(rows)
    inputs = {n: torch.randn(rows, n, generator=generator) for n in {l.in_features for l in layers}}

    def one_pass() -> None:
        for layer in layers:
            x = inputs[layer.in_features]
            for part in layer.parts:
                layer.kernels.gemm(part.kind, x, part.codes, part.scales, part.minima)

    return median_seconds(one_pass, repeats)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.blocks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--rows", default="1,4,8,16", help="comma-separated row counts")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=("float32", "int8-activations"))
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    model = load_model(args.model, dtype=args.dtype, progress=False)
    layers = [m for m in model.module.modules() if isinstance(m, BlockLinear)]
    if not layers:
        raise SystemExit(f"{args.model} has no projections on blocks here "
                         "(not a GGUF model, or no native kernels)")
    total_bytes = sum(block_bytes(layer) for layer in layers)
    flops_per_row = sum(2 * layer.in_features * layer.out_features for layer in layers)
    bandwidth = copy_bandwidth_gbs()
    rows_out = []
    for rows in (int(r) for r in args.rows.split(",")):
        seconds = time_pass(layers, rows, args.repeats)
        rows_out.append({"rows": rows, "pass_ms": round(seconds * 1e3, 3),
                         "gflops": round(flops_per_row * rows / seconds / 1e9, 2),
                         "read_gbs": round(total_bytes / seconds / 1e9, 3)})
        print(f"rows {rows:4d}  {seconds * 1e3:8.2f} ms  {rows_out[-1]['gflops']:6.1f} GFLOP/s  "
              f"blocks {total_bytes / 1e6:6.1f} MB at {total_bytes / seconds / 1e9:5.1f} GB/s "
              f"(copy bandwidth {bandwidth:.1f} GB/s)")
    report = {"model": args.model, "dtype": args.dtype, "projections": len(layers),
              "kinds": sorted({part.kind for layer in layers for part in layer.parts}),
              "block_mb": round(total_bytes / 1e6, 2), "max_rows": layers[0].max_rows,
              "copy_bandwidth_gbs": bandwidth, "passes": rows_out}
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
