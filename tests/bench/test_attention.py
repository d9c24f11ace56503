"""The decode-attention benchmark reports every batch x context, with the bytes each
step's attention reads, for fp32 and bf16 caches."""

import json

import pytest

from bench.attention import main


@pytest.mark.parametrize("cache_dtype,itemsize", [("float32", 4), ("bfloat16", 2)])
def test_attention_benchmark_reports_each_combination(tmp_path, cache_dtype, itemsize):
    report_path = tmp_path / "attention.json"
    main(["--batch", "1,3", "--context", "20,70", "--layers", "2", "--repeats", "2",
          "--cache-dtype", cache_dtype, "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    assert [(r["batch"], r["context"]) for r in report["steps"]] == [(1, 20), (3, 20), (1, 70),
                                                                   (3, 70)]
    assert report["copy_bandwidth_gbs"] > 0 and report["cache_dtype"] == cache_dtype
    for row in report["steps"]:
        # K and V of every layer: 2 x layers x batch x context x KV heads x head size
        assert row["kv_mb"] == round(2 * 2 * row["batch"] * row["context"] * 3 * 64
                                     * itemsize / 1e6, 3)
        assert row["step_ms"] > 0
        assert row["read_gbs"] == pytest.approx(row["kv_mb"] / row["step_ms"], rel=0.05)


def test_chunk_rows_are_timed_and_checked(tmp_path):
    """--chunk-rows runs each request as a prefill chunk (rows over growing contexts);
    more rows than the context holds is refused before anything runs."""
    report_path = tmp_path / "chunks.json"
    main(["--batch", "2", "--context", "24", "--chunk-rows", "12", "--layers", "1",
          "--repeats", "1", "--cache-dtype", "bfloat16", "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    assert report["chunk_rows"] == 12 and report["steps"][0]["step_ms"] > 0
    with pytest.raises(SystemExit):
        main(["--batch", "1", "--context", "8", "--chunk-rows", "9"])
