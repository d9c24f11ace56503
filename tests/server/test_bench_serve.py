"""The online benchmark drives the real server and reports every level."""

import json

from bench.serve import main


def test_bench_serve_against_the_real_server(server, tmp_path):
    report_path = tmp_path / "serve.json"
    report = main(["--base-url", server.base_url, "--api-key", server.api_key,
                   "--concurrency", "1,3", "--num-requests", "3", "--input-len", "8",
                   "--output-len", "6", "--json", str(report_path)])
    assert json.loads(report_path.read_text()) == report
    for level in report["levels"]:
        assert level["errors"] == 0 and level["requests"] == 3
        assert level["output_tokens"] == 3 * 6            # ignore_eos: exactly max_tokens
        assert level["ttft_ms"]["p50"] > 0 and level["itl_ms"]["p50"] > 0
        assert level["output_tokens_per_s"] > 0


def test_bench_serve_on_text_completions(server):
    report = main(["--base-url", server.base_url, "--api-key", server.api_key,
                   "--endpoint", "completions", "--concurrency", "2", "--num-requests", "2",
                   "--input-len", "8", "--output-len", "5"])
    assert report["workload"]["endpoint"] == "completions"
    level = report["levels"][0]
    assert level["errors"] == 0 and level["output_tokens"] == 2 * 5
    assert level["ttft_ms"]["p50"] > 0 and level["itl_ms"]["p50"] > 0
