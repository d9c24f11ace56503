"""bf16 matmuls as the engine runs them: the native bf16 GEMM (engine/kernels/
bf16_gemm.c) against oneDNN on its own packed weights, and against float32's
product (oneDNN on packed fp32 weights), side by side in one run.

    python -m bench.matmul --rows 8,32,64,256 --shapes 576x3072,1536x576,576x49152

For each shape (in x out) it makes `--weights` distinct random bf16 weights (30: one
per layer of the default model, so the weights stream from memory as in a decode
step, not from the CPU's caches), packs each both ways (packed_linear.pack_weight),
and times one product per weight with each path, alternating, for every row count.
Prints GFLOP/s of both and their ratio; `--json` writes them. On CPUs with AMX the
native GEMM is timed both ways, on AMX tiles (`amx`, what serves there) and on the
AVX512-BF16 loop (`native`, what KVSERVE_AMX=0 keeps).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from engine.models.packed_linear import pack_weight

from .report import write_json


def _seconds(run, weights, repeats: int) -> float:
    """Median seconds of one product, over `repeats` sweeps of all the weights."""
    run(weights[0])
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        for weight in weights:
            run(weight)
        times.append((time.perf_counter() - started) / len(weights))
    return statistics.median(times)


def measure(rows: int, in_features: int, out_features: int, num_weights: int,
            repeats: int) -> dict:
    generator = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, in_features, generator=generator).bfloat16()
    dense = [torch.randn(out_features, in_features, generator=generator)
             for _ in range(num_weights)]
    weights = [pack_weight(weight.bfloat16()) for weight in dense]
    if weights[0] is None or weights[0].pairs is None:
        raise SystemExit("no native bf16 GEMM here (no AVX2 or AVX512-BF16, or no compiler)")
    kernels = weights[0].kernels
    fp32_weights = [pack_weight(weight).onednn for weight in dense]
    x32 = x.float()

    def native(weight):
        kernels.bf16_gemm(x, weight.pairs, out_features, torch.bfloat16)

    def onednn(weight):
        torch.ops.mkldnn._linear_pointwise(x, weight.onednn, None, "none", [], "")

    def fp32(weight):
        torch.ops.mkldnn._linear_pointwise(x32, weight, None, "none", [], "")

    def best(run) -> float:
        return min(_seconds(run, weights, repeats), _seconds(run, weights, repeats))

    flops = 2 * rows * in_features * out_features
    amx = kernels.amx_enabled
    row = {"rows": rows, "in": in_features, "out": out_features}
    if amx:
        row["amx_gflops"] = round(flops / best(native) / 1e9, 1)
        kernels.enable_amx(False)
    try:
        native_s = best(native)
    finally:
        kernels.enable_amx(amx)
    row["native_gflops"] = round(flops / native_s / 1e9, 1)
    if weights[0].onednn is not None:       # oneDNN packs bf16 on this CPU
        onednn_s = best(onednn)
        row.update({"onednn_gflops": round(flops / onednn_s / 1e9, 1),
                    "native_over_onednn": round(onednn_s / native_s, 2)})
    fp32_s = min(_seconds(fp32, fp32_weights, repeats), _seconds(fp32, fp32_weights, repeats))
    row.update({"fp32_gflops": round(flops / fp32_s / 1e9, 1),
                "native_over_fp32": round(fp32_s / native_s, 2)})
    return row


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.matmul", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="8,16,32,64,256")
    parser.add_argument("--shapes", default="576x3072,1536x576,576x960,576x49152",
                        help="comma-separated IN x OUT")
    parser.add_argument("--weights", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    results = []
    for shape in args.shapes.split(","):
        in_features, out_features = (int(v) for v in shape.split("x"))
        count = args.weights if in_features * out_features < 10_000_000 else 2
        for rows in (int(r) for r in args.rows.split(",")):
            row = measure(rows, in_features, out_features, count, args.repeats)
            results.append(row)
            amx = f"  AMX {row['amx_gflops']:6.1f}" if "amx_gflops" in row else ""
            onednn = (f"  oneDNN bf16 {row['onednn_gflops']:6.1f} "
                      f"({row['native_over_onednn']:.2f}x)" if "onednn_gflops" in row else "")
            print(f"{rows:5d} x {in_features:5d} -> {out_features:6d}{amx}  native "
                  f"{row['native_gflops']:6.1f}{onednn}  fp32 {row['fp32_gflops']:6.1f} "
                  f"({row['native_over_fp32']:.2f}x) GFLOP/s", flush=True)
    report = {"threads": torch.get_num_threads(), "results": results}
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
