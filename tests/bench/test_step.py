"""The decode-step benchmark runs on a tiny model and reports every batch x context."""

import json

from bench.step import main
from tests.helpers import block_kernel_rows, has_bf16_gemm


def test_step_benchmark_reports_each_combination(tiny_models, tmp_path):
    path, _ = tiny_models["qwen3"]
    report_path = tmp_path / "step.json"
    main(["--model", str(path), "--batch", "1,3", "--context", "5,40", "--repeats", "2",
          "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    assert [(r["batch"], r["context"]) for r in report["steps"]] == [(1, 5), (3, 5), (1, 40), (3, 40)]
    for row in report["steps"]:
        assert row["step_ms"] > 0
        assert abs(row["tokens_per_s"] - row["batch"] / row["step_ms"] * 1000) < 0.2 * row["tokens_per_s"]
    assert report["native_kernels"] is True
    assert report["machine"]["copy_bandwidth_gbs"] > 0
    for row in report["steps"]:      # fractions of the limits measured in the same run
        assert row["weight_mb"] > 0 and 0 < row["bandwidth_fraction"] < 5
        assert abs(row["bandwidth_fraction"] - row["bandwidth_bound_ms"] / row["step_ms"]) < 0.01
        assert 0 < row["matmul_fraction"] < 5


def test_compare_loop_times_the_layer_loop_beside_the_stacks(tiny_models, tmp_path):
    from bench.step import time_loop
    from engine import load_model

    path, _ = tiny_models["qwen3"]
    report_path = tmp_path / "step.json"
    main(["--model", str(path), "--batch", "1,3", "--context", "5", "--repeats", "2",
          "--compare-loop", "--json", str(report_path)])
    rows = json.loads(report_path.read_text())["steps"]
    assert [r["batch"] for r in rows] == [1, 3] and all(r["loop_step_ms"] > 0 for r in rows)
    model = load_model("smollm2-135m-instruct", dtype="bf16-weights", progress=False)
    stacks, row = model.module.executors.stacks, {}
    assert len(stacks) == (2 if has_bf16_gemm() else 1)    # PackedStack needs the bf16 GEMM
    assert time_loop(model, 8, 20, 2, row) == row["loop_step_ms"] > 0
    assert model.module.executors.stacks is stacks        # put back for the next step


def test_weight_bytes_follow_the_path_a_step_takes():
    """The default model's 1-row step reads the GGUF blocks (~5 and ~9 bits per
    weight). On builds with panels the model keeps no dense copy, so a step past the
    row kernels' crossover reads the same blocks; elsewhere it reads the packed fp32
    weights, about 4-6x the bytes."""
    from bench.bounds import matmul_flops_per_row, weight_bytes_per_step
    from engine import load_model

    module = load_model("smollm2-135m-instruct", progress=False).module
    large_step = block_kernel_rows() + 1
    small, large = weight_bytes_per_step(module, 1), weight_bytes_per_step(module, large_step)
    panels = block_kernel_rows() > 12
    assert 60e6 < small < 130e6
    assert large == small if panels else 3.5 < large / small < 6.5
    assert 2 * 130e6 < matmul_flops_per_row(module) < 2 * 140e6
