"""bench.matmul times the native bf16 GEMM, oneDNN on the same packed weights and
float32's product, and reports the rates and ratios (and, where AMX serves, the tiles' rate too, the
tiles left as they were)."""

from __future__ import annotations

import json

import pytest
import torch

from engine.kernels import load_native_kernels
from engine.models.packed_linear import pack_weight


def test_matmul_bench_reports_both_paths(tmp_path):
    kernels = load_native_kernels()
    if kernels is None or not kernels.has_bf16_gemm:
        pytest.skip("no native bf16 GEMM on this CPU")
    from bench.matmul import main

    serving = kernels.amx_enabled
    out = tmp_path / "matmul.json"
    report = main(["--rows", "8,33", "--shapes", "256x384", "--weights", "2", "--repeats", "1",
                   "--json", str(out)])
    assert [(r["rows"], r["in"], r["out"]) for r in report["results"]] == [(8, 256, 384), (33, 256, 384)]
    onednn = pack_weight(torch.zeros(16, 16).bfloat16()).onednn is not None
    for row in report["results"]:
        assert row["native_gflops"] > 0 and row["fp32_gflops"] > 0
        assert ("onednn_gflops" in row) == onednn    # where oneDNN packs bf16 weights
        assert ("amx_gflops" in row) == kernels.amx_enabled      # timed both ways where AMX serves
        # the rates are rounded to 0.1 GFLOP/s, the ratios come from the raw times
        if onednn:
            assert row["native_over_onednn"] == pytest.approx(
                row["native_gflops"] / row["onednn_gflops"], rel=0.15)
        assert row["native_over_fp32"] == pytest.approx(
            row["native_gflops"] / row["fp32_gflops"], rel=0.15)
    assert json.loads(out.read_text()) == report
    assert kernels.amx_enabled == serving
