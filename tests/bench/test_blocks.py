"""The block-kernel benchmark times every projection of the default model that runs
on blocks, for each row count asked."""

import json

import pytest

from bench.blocks import main


def test_blocks_benchmark_reports_each_row_count(tmp_path):
    report_path = tmp_path / "blocks.json"
    main(["--rows", "1,3", "--repeats", "1", "--json", str(report_path)])
    report = json.loads(report_path.read_text())
    # 30 layers x (qkv, o, gate_up, down) and the Q8_0 LM head
    assert report["projections"] == 121 and report["kinds"] == ["Q4_1", "Q8_0"]
    assert 100 < report["block_mb"] < 130 and report["copy_bandwidth_gbs"] > 0
    assert [p["rows"] for p in report["passes"]] == [1, 3]
    for row in report["passes"]:
        assert row["pass_ms"] > 0
        assert row["read_gbs"] == pytest.approx(report["block_mb"] / row["pass_ms"], rel=0.05)
