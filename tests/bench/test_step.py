"""The decode-step benchmark runs on a tiny model and reports every batch x context."""

import json

from bench.step import main


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
