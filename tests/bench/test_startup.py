"""bench.random_gguf writes a GGUF the engine reads in place and transformers loads;
bench.startup reports a server's ready time, peak memory and bytes written."""

from __future__ import annotations

import sys

import torch

from bench.random_gguf import LlamaShape, write_random_gguf
from bench.startup import main as startup
from tests.server.conftest import free_port

SMALL = LlamaShape(layers=2, hidden=128, intermediate=256, heads=4, kv_heads=2)


def test_a_random_gguf_serves_from_its_blocks_like_transformers(tmp_path):
    """Greedy tokens on the file's blocks (no dense copy) equal transformers' own GGUF
    load of it, up to where fp32 summation order could flip a near tie."""
    from transformers import AutoModelForCausalLM

    from engine import GenerationConfig, load_model
    from engine.models.block_weights import BlockLinear

    path = write_random_gguf(str(tmp_path / "small.gguf"), SMALL)
    model = load_model(path, progress=False, cache_dir=tmp_path / "cache")
    projections = [m for m in model.module.modules() if isinstance(m, BlockLinear)]
    assert len(projections) == 2 * 4 + 1
    reference = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="small.gguf",
                                                     dtype=torch.float32).eval()
    prompt = [5, 17, 300, 42, 9000, 12]
    ours = model.generate_batch([prompt], GenerationConfig(max_new_tokens=6, eos_token_id=[]))
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt])).logits[0, -1]
    first = next(iter(ours.values())).generated_tokens[0]
    assert logits[first] >= logits.max() - 1e-4


def test_the_report_counts_ready_time_peak_memory_and_bytes_written(tmp_path):
    port = free_port()
    watched = tmp_path / "cache"
    watched.mkdir()
    script = (f"import http.server, pathlib; pathlib.Path(r'{watched}/blob').write_bytes(bytes(5000)); "
              f"http.server.test(HandlerClass=http.server.SimpleHTTPRequestHandler, port={port}, "
              "bind='127.0.0.1')")
    result = startup(["--label", "toy", "--port", str(port), "--health", "/",
                      "--concurrency", "", "--watch-dir", str(watched), "--",
                      sys.executable, "-c", script])
    assert 0 < result["ready_s"] < 60
    assert 5 < result["peak_rss_after_start_mb"] < 500
    assert result["bytes_written"] == 5000 and "serve" not in result
