"""The profiling tools: decode_ops counts a decode step's kernels, folded summarises
py-spy's samples, host_ops times single torch calls."""

from __future__ import annotations

import torch

from bench import decode_ops, folded, host_ops, profile as profile_tool


def test_decode_ops_counts_each_layers_kernels_once(tiny_models):
    path, _ = tiny_models["llama"]
    report = decode_ops.main(["--model", str(path), "--dtype", "bfloat16", "--requests", "3",
                              "--context", "20"])
    layers, by_op = report["layers"], report["by_op"]
    assert by_op["scaled_dot_product_attention"] == layers       # one attention per layer
    assert by_op["index_copy_"] == 2 * layers                    # K and V written per layer
    # half-precision norms: one op each (two per layer and the final one), no casts
    # around them (fewer casts in the whole step than norms)
    norms = 2 * layers + 1
    assert by_op["rms_norm"] == norms and "pow" not in by_op and by_op.get("to", 0) < norms
    # the step's gather indices and additive mask: built once, not per layer, and SDPA
    # gets no bool mask to convert in every layer
    assert by_op["arange"] == 1 and by_op["lt"] == 1
    assert "where (SDPA's bool mask)" not in by_op
    # the static buffers' copies run outside the graph: not counted
    assert "copy_" not in by_op and "fill_" not in by_op


def test_decode_ops_counts_what_composite_and_copying_ops_run():
    """A reshape that has to copy counts, one that views does not; SDPA with a bool
    mask counts the conversion it makes on every call."""
    counter = decode_ops.OpCounter()
    x = torch.randn(4, 6)
    q = torch.randn(1, 1, 2, 8)
    mask = torch.ones(1, 1, 2, 2, dtype=torch.bool)
    with torch.inference_mode(), counter:        # as the engine's steps run
        x.reshape(6, 4)                          # a view
        x.t().reshape(24)                        # a copy
        torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
        x.to(torch.float32)                      # returns x itself: no kernel
    assert counter.counts == {"reshape": 1, "scaled_dot_product_attention": 1,
                              "where (SDPA's bool mask)": 1}


def test_folded_summarises_one_thread(tmp_path):
    samples = tmp_path / "samples.folded"
    samples.write_text(
        "thread (1): MainThread;main (a.py:1);wait (b.py:2) 10\n"
        "thread (7): kvserve-engine;run (e.py:3);step (e.py:9);sync (s.py:4) 6\n"
        "thread (7): kvserve-engine;run (e.py:3);step (e.py:10);launch (l.py:5) 2\n"
        "thread (8): kvserve-engine;run (e.py:3) 1\n")
    text = folded.summarise(folded.read_stacks(str(samples)), "kvserve-engine", None, 10)
    lines = text.splitlines()
    assert lines[0] == "thread (7): kvserve-engine: 8 samples"     # the busiest such thread
    assert "      6  75.0% sync (s.py:4)" in lines
    # inclusive: line numbers dropped, so step's two lines count as one function
    assert "      8 100.0% step (e.py)" in lines


def test_host_ops_times_calls_on_the_cpu():
    results = host_ops.main(["--device", "cpu", "--calls", "50"])
    assert results["device"] == "cpu"
    for name in ("python_1000_adds", "host_tensor_from_list", "device_add_", "copy_to_device"):
        assert results[name] > 0


def test_profile_reports_the_engine_threads_ops(tiny_models, capsys):
    """The engine steps on its own thread: the tables must hold its ops (a decode
    step's matmuls), not only the caller's."""
    path, _ = tiny_models["llama"]
    profile_tool.main(["--model", str(path), "--device", "cpu", "--dtype", "float32",
                  "--num-prompts", "2", "--input-len", "6", "--output-len", "4"])
    printed = capsys.readouterr().out
    first = printed.splitlines()[0]
    assert "for 4 steps:" in first and "ms a step" in first
    assert any(op in printed for op in ("_linear_pointwise", "aten::linear", "aten::addmm",
                                        "aten::mm"))
