"""Compiled layer steps (engine/step/compile_paths.py): which paths a config compiles on
which device, transformers' greedy tokens through compiled varlen steps (inductor,
with the CPU's native shortcuts stepping aside while traced), and a failed
compilation falling back to eager without losing the step."""

from __future__ import annotations

import logging

import pytest

import torch
from torch._dynamo.utils import counters

from engine import ContinuousBatchingConfig, GenerationConfig
from engine.step.compile_paths import CompileSettings, plan_compile
from tests.helpers import needs_torch_at_cpu_level, random_prompts, reference_greedy

pytestmark = needs_torch_at_cpu_level
CPU, CUDA = torch.device("cpu"), torch.device("cuda")


def plan(device=CUDA, flash=False, fast_path=True, distributed=False, **config):
    return plan_compile(ContinuousBatchingConfig(**config), device, flash, fast_path, distributed)


def test_levels_give_both_paths_settings_on_accelerators():
    assert plan() == plan(default_compile_level=0) == plan(CPU, default_compile_level=0)
    one = CompileSettings(mode="default", dynamic=True)
    assert plan(default_compile_level=1).varlen == plan(default_compile_level=1).decode == one
    two = plan(default_compile_level=2).decode
    assert two.mode == "max-autotune-no-cudagraphs" and two.dynamic is True
    three = plan(default_compile_level=3).varlen
    assert three.mode == "max-autotune-no-cudagraphs" and three.dynamic is False
    flash = plan(flash=True, default_compile_level=1)       # varlen max_seqlen_k varies
    assert flash.varlen is None and flash.decode == one


def test_explicit_configs_win_and_cpu_ignores_levels(caplog):
    from transformers import CompileConfig

    explicit = plan(default_compile_level=1, varlen_compile_config={"backend": "aot_eager"})
    assert explicit.varlen == CompileSettings(backend="aot_eager")
    assert explicit.decode.mode == "default"
    hf = plan(decode_compile_config=CompileConfig(fullgraph=True, mode="default")).decode
    assert hf.fullgraph and hf.mode == "default"
    with caplog.at_level(logging.INFO, logger="engine.step.compile_paths"):
        whole = plan(varlen_compile_config=CompileConfig(fullgraph=True, mode="default"))
    assert whole.varlen == CompileSettings(fullgraph=False, dynamic=None, mode="default")
    assert "varlen_compile_config: fullgraph off" in caplog.text
    with caplog.at_level(logging.INFO, logger="engine.step.compile_paths"):
        cpu = plan(CPU, fast_path=False, default_compile_level=2,
                   decode_compile_config={"dynamic": True},
                   varlen_compile_config={"dynamic": True})
    assert cpu.varlen == CompileSettings(dynamic=True) and cpu.decode is None
    assert "no compile settings on CPU" in caplog.text
    assert "decode_compile_config ignored: the decode fast path is off" in caplog.text


def test_no_compile_where_torch_is_held_below_the_cpu(caplog, monkeypatch):
    """--cpu-isa avx2 on a bigger CPU holds ATen to AVX2 (isa.cap_torch); inductor's CPU
    code then disagrees with ATen's (a tiny Llama's compiled steps gave token 0
    throughout), so CPU steps are not compiled; GPU steps are not affected."""
    from engine.kernels.isa import choose_level, cpu_features

    if choose_level(cpu_features()).torch_capability == "default":
        pytest.skip("this CPU's best level is torch's lowest")
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    with caplog.at_level(logging.WARNING, logger="engine.step.compile_paths"):
        assert plan(CPU, varlen_compile_config={"dynamic": True}) == plan()
    assert "compile off: torch is held to default" in caplog.text
    assert plan(CUDA, varlen_compile_config={"dynamic": True}).varlen is not None


def test_tensor_parallelism_and_cuda_graph_modes_are_named(caplog):
    with caplog.at_level(logging.WARNING, logger="engine.step.compile_paths"):
        assert plan(distributed=True, default_compile_level=1) == plan()
        plan(varlen_compile_config={"mode": "reduce-overhead"})
    assert "compile off: tensor parallelism" in caplog.text
    options = plan(varlen_compile_config={"options": {"max_autotune": True}}).varlen
    assert options.options == {"max_autotune": True}
    assert "'reduce-overhead' records CUDA graphs of its own" in caplog.text


def _generate(model, prompts, max_new_tokens, **config):
    outputs = model.generate_batch(
        prompts, GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=[]),
        ContinuousBatchingConfig(**config), persistent_manager=True)
    manager = model.kept_manager
    stats = manager.stats()
    manager.destroy()
    return [o.generated_tokens for o in outputs.values()], stats


def test_compiled_varlen_steps_give_transformers_tokens(tiny_llama):
    """inductor on the CPU's packed fp32 weights, chunked prefill and batched decode;
    every step (the warm-up prefill too) runs compiled layers."""
    model, reference = tiny_llama
    prompts = random_prompts(5, 3, 70, seed=31)
    want = [reference_greedy(reference, p, 10) for p in prompts]
    graphs_before = counters["stats"]["unique_graphs"]
    tokens, stats = _generate(model, prompts, 10, max_batch_tokens=64,
                              varlen_compile_config={"dynamic": True})
    assert tokens == want
    assert stats["num_compiled_steps"] == stats["num_steps"] + 1
    assert counters["stats"]["unique_graphs"] > graphs_before     # graphs were built


def test_one_set_of_varlen_graphs_serves_every_kind_of_step(tiny_llama):
    """Varlen attention runs outside the compiled graphs, so their guards never see how
    many chunks a step has or where they start: graphs built for one workload serve
    another whose steps hold other numbers of chunks (before, each kind of step was a
    graph of its own, and the ninth ran eagerly). A counting backend records every
    graph torch builds."""
    graphs = []

    def counting_backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    model, reference = tiny_llama
    config = {"varlen_compile_config": {"backend": counting_backend, "dynamic": True},
              "max_requests_per_batch": 8}
    first = random_prompts(4, 20, 40, seed=34)
    # a limit no run here reaches, so a kind of step past it cannot hide as eager
    with torch._dynamo.config.patch(recompile_limit=64):
        tokens, stats = _generate(model, first, 3, max_batch_tokens=64, **config)
        assert tokens == [reference_greedy(reference, p, 3) for p in first]
        assert stats["num_compiled_steps"] > stats["num_steps"] > 0 and graphs
        built = len(graphs)
        # other chunk counts per step (up to 8 prompts of 5-90 tokens in 160-token
        # steps), chunks that continue a prompt, decodes beside prefill chunks
        second = random_prompts(12, 5, 90, seed=35)
        tokens, stats = _generate(model, second, 4, max_batch_tokens=160, **config)
    assert tokens == [reference_greedy(reference, p, 4) for p in second]
    assert stats["num_compiled_steps"] > stats["num_steps"]
    assert len(graphs) == built


def test_compiled_steps_of_a_hybrid_sliding_model(tiny_gemma3):
    """Gemma 3's sliding and full layers share the compiled step (aot_eager: the
    trace without inductor's code generation)."""
    model, reference = tiny_gemma3
    prompts = random_prompts(3, 20, 40, seed=32)
    want = [reference_greedy(reference, p, 8) for p in prompts]
    tokens, stats = _generate(model, prompts, 8, varlen_compile_config={"backend": "aot_eager"})
    assert tokens == want and stats["num_compiled_steps"] > stats["num_steps"] > 0


def test_a_failed_compilation_runs_the_step_eagerly(tiny_llama, caplog):
    def broken_backend(graph_module, example_inputs):
        raise RuntimeError("no code generator here")

    model, reference = tiny_llama
    prompts = random_prompts(3, 5, 20, seed=33)
    with caplog.at_level(logging.WARNING, logger="engine.step.compile_paths"):
        tokens, stats = _generate(model, prompts, 6,
                                  varlen_compile_config={"backend": broken_backend})
    assert tokens == [reference_greedy(reference, p, 6) for p in prompts]
    assert stats["num_compiled_steps"] == 0
    assert "compile of the varlen path failed" in caplog.text
