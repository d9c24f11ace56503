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
