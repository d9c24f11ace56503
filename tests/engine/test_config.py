import pytest
import torch

from engine import ContinuousBatchingConfig, GenerationConfig
from engine.errors import InvalidRequestError
from engine.kv_cache.sizing import CPU_DEFAULT_KV_CACHE_BYTES, compute_sizing


def test_page_size_below_four_is_rejected_naming_the_field():
    with pytest.raises(ValueError, match="page_size"):
        ContinuousBatchingConfig(page_size=3)


def test_block_size_is_a_deprecated_alias_of_page_size():
    with pytest.warns(FutureWarning, match="block_size"):
        config = ContinuousBatchingConfig(block_size=32)
    assert config.page_size == 32


@pytest.mark.parametrize("field,value", [
    ("scheduler_type", "lifo"), ("safety_margin", 1.5), ("max_memory_percent", 0.0),
    ("num_blocks", 0), ("max_batch_tokens", -1), ("default_compile_level", 4),
    ("max_queue_size", -1), ("cpu_offload_space", -1.0), ("cpu_group_timeout", 1.0),
    ("use_cuda_graph", (1, 2)), ("use_cuda_graph", (True,)),
    ("varlen_compile_config", {"fullgrap": True}), ("decode_compile_config", "inductor"),
    ("decode_compile_config", {"mode": "default", "options": {"max_autotune": True}}),
])
def test_invalid_values_name_their_field(field, value):
    with pytest.raises(ValueError, match=field):
        ContinuousBatchingConfig(**{field: value})


def test_safety_margin_defaults_depend_on_the_scheduler():
    assert ContinuousBatchingConfig().resolved_safety_margin == 0.15
    assert ContinuousBatchingConfig(scheduler_type="prefill_first").resolved_safety_margin == 0.0
    assert ContinuousBatchingConfig(safety_margin=0.3).resolved_safety_margin == 0.3


def test_config_is_frozen():
    config = ContinuousBatchingConfig()
    with pytest.raises(Exception):
        config.page_size = 8


def test_generation_config_accepts_a_transformers_config():
    from transformers import GenerationConfig as HFGenerationConfig

    ours = GenerationConfig.from_any(HFGenerationConfig(max_new_tokens=7, do_sample=True,
                                                        temperature=0.5, eos_token_id=[4, 5]))
    assert (ours.max_new_tokens, ours.do_sample, ours.temperature) == (7, True, 0.5)
    assert ours.eos_token_id == [4, 5]


def test_generation_config_validates_sampling_values():
    with pytest.raises(InvalidRequestError, match="top_p"):
        GenerationConfig(top_p=0.0)
    with pytest.raises(InvalidRequestError, match="temperature"):
        GenerationConfig(temperature=float("nan"))


def sizing(**overrides):
    config = ContinuousBatchingConfig(**overrides)
    return compute_sizing(config, num_layers=30, num_kv_heads=3, head_dim=64, hidden_size=576,
                          intermediate_size=1536, dtype=torch.float32,
                          device=torch.device("cpu"), logit_processing=False)


def test_cpu_default_sizing_is_capped_and_budget_in_range():
    result = sizing(page_size=16)
    assert result.num_blocks * result.block_bytes <= CPU_DEFAULT_KV_CACHE_BYTES
    assert 256 <= result.max_batch_tokens <= 8192
    assert result.block_bytes == 2 * 30 * 16 * 3 * 64 * 4


def test_explicit_sizes_are_kept():
    result = sizing(num_blocks=10, max_batch_tokens=300, max_requests_per_batch=5)
    assert (result.num_blocks, result.max_batch_tokens, result.max_requests_per_batch) == (10, 300, 5)


def test_max_requests_per_batch_is_fitted_to_blocks():
    assert sizing(num_blocks=7).max_requests_per_batch == 7


def test_max_blocks_per_request_resolution(tiny_llama, caplog):
    model, _ = tiny_llama
    generation = GenerationConfig(max_new_tokens=8)

    def stats(hints=None, **config):
        manager = model.init_continuous_batching(
            generation, ContinuousBatchingConfig(page_size=16, num_blocks=32, **config),
            workload_hints=hints)
        result = manager.stats()
        manager.destroy()
        return result

    assert stats()["max_blocks_per_request"] == 32                       # fallback
    assert stats({"max_prompt_length": 40, "max_generated_length": 25}) \
        ["max_blocks_per_request"] == 5                                  # ceil(65 / 16)
    assert stats(max_blocks_per_request=0)["max_blocks_per_request"] == 0
    with caplog.at_level("WARNING", logger="engine.step.feature_gates"):
        explicit = stats(max_blocks_per_request=7)
    assert explicit["max_blocks_per_request"] == 7
    assert explicit["decode_fast_path"] == 0                             # no flash-attn on CPU
    assert "decode fast path off" in caplog.text
