"""The offline benchmark runs end to end on a tiny model and reports every system."""

import json

from bench.offline import main


def test_offline_benchmark_reports_ours_and_peers(tiny_models, tmp_path):
    path, _ = tiny_models["llama"]
    report_path, plot_path = tmp_path / "report.json", tmp_path / "report.png"
    main(["--model", str(path), "--num-prompts", "4", "--input-len", "8", "--output-len", "5",
          "--page-size", "16", "--peers", "transformers-static",
          "--json", str(report_path), "--plot", str(plot_path)])
    report = json.loads(report_path.read_text())
    assert set(report["results"]) == {"kvserve", "transformers-static"}
    for result in report["results"].values():
        assert result["output_tokens"] == 4 * 5          # EOS ignored: exactly the work asked
        assert result["output_tokens_per_s"] > 0
    assert report["results"]["kvserve"]["kvserve_speedup"] == 1.0
    assert report["machine"]["copy_bandwidth_gbs"] > 0
    assert plot_path.stat().st_size > 1000
    engine = report["engine"]            # what served the timed run (one prefill, 4 decodes)
    assert engine["num_steps"] == 5 and engine["num_graph_steps"] == 0


def test_async_batching_switch_reaches_the_engine(tiny_models):
    """--async-batching on turns lookahead decode steps on where the default leaves
    them off (a CPU), and the report says which was asked for."""
    path, _ = tiny_models["llama"]
    common = ["--model", str(path), "--num-prompts", "2", "--input-len", "8",
              "--output-len", "6", "--page-size", "16"]
    on = main(common + ["--async-batching", "on"])
    auto = main(common)
    assert on["workload"]["async_batching"] == "on" and auto["workload"]["async_batching"] == "auto"
    assert on["engine"]["async_batching"] == 1 and on["engine"]["num_lookahead_steps"] > 0
    assert auto["engine"]["async_batching"] == 0 and auto["engine"]["num_lookahead_steps"] == 0
    assert on["results"]["kvserve"]["output_tokens"] == 2 * 6
