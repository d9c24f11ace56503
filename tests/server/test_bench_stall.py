"""The stall benchmark drives the real server: its streams and the long chat each get
every token they asked for, and the report measures them."""

import json

from bench.stall import main


def test_bench_stall_against_the_real_server(server, tmp_path):
    report_path = tmp_path / "stall.json"
    report = main(["--base-url", server.base_url, "--api-key", server.api_key,
                   "--streams", "3", "--input-len", "6", "--output-len", "12",
                   "--long-words", "60", "--long-output-len", "4", "--delay", "0.05",
                   "--json", str(report_path)])
    assert json.loads(report_path.read_text()) == report
    assert report["errors"] == 0
    assert report["stream_output_tokens"] == [12, 12, 12]      # ignore_eos: exactly max_tokens
    assert report["long_output_tokens"] == 4
    assert report["long_ttft_ms"] > 0
    assert report["longest_gap_ms"] >= report["itl_ms"]["p99"] >= report["itl_ms"]["p50"] > 0
