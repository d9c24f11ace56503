"""Model specs: local directories, transformers models, hub ids (offline), errors."""

import pytest
import torch

from engine import load_model
from engine.loading.model_files import ModelLoadError, resolve_model_dir
from tests.helpers import bf16_gemm_levels, cpu_isa, needs_bf16_gemm


def test_local_directory_and_transformers_model_load_the_same_weights(tiny_models):
    path, reference = tiny_models["qwen3"]
    from_dir = load_model(path, progress=False)
    from_module = load_model(reference)
    ids = [5, 9, 13, 17, 21]
    torch.testing.assert_close(from_dir.prompt_logits(ids), from_module.prompt_logits(ids))
    assert from_dir.generation_config.eos_token_id == 2


def test_bfloat16_load_keeps_rope_in_fp32(tiny_models):
    path, _ = tiny_models["llama"]
    model = load_model(path, dtype="bfloat16", progress=False)
    assert model.dtype == torch.bfloat16
    assert model.module.rotary.inv_freq.dtype == torch.float32
    assert torch.isfinite(model.prompt_logits([4, 5, 6])).all()


def test_hub_id_offline_gives_a_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="could not download 'nobody/nothing'"):
        load_model("nobody/nothing")


def test_loading_pauses_the_collector_and_gives_it_back(tiny_models):
    """load_model runs with the cyclic collector off (its objects are long-lived) and
    leaves it as it found it, on success and on failure."""
    import gc

    path, _ = tiny_models["llama"]
    seen = []
    gc.callbacks.append(lambda phase, info: seen.append(phase))
    try:
        load_model(path, progress=False)
        assert seen == [] and gc.isenabled()
        with pytest.raises(ModelLoadError):
            load_model("./missing-dir")
        assert gc.isenabled()
        gc.disable()
        load_model(path, progress=False)
        assert not gc.isenabled()
    finally:
        gc.enable()
        gc.callbacks.pop()


@pytest.mark.parametrize("spec", ["/does/not/exist.gguf", "./missing-dir", "a/b/c"])
def test_unknown_specs_are_rejected(spec):
    with pytest.raises(ModelLoadError):
        resolve_model_dir(spec)


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        resolve_model_dir(str(tmp_path))


def test_an_architecture_the_paged_cache_cannot_serve_is_rejected_by_name(tmp_path):
    from transformers import MambaConfig, MambaForCausalLM

    MambaForCausalLM(MambaConfig(num_hidden_layers=1, hidden_size=16, state_size=4,
                                 vocab_size=50)).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="model_type 'mamba'"):
        load_model(tmp_path, progress=False)


def test_float32_cpu_models_multiply_weights_packed_for_onednn(tiny_models):
    from engine.models.packed_linear import PackedLinear

    path, reference = tiny_models["qwen2"]                 # qkv bias, tied embeddings
    model = load_model(path, progress=False)
    packed = [m for m in model.module.modules() if isinstance(m, PackedLinear)]
    assert len(packed) == 4 * len(model.module.layers) + 1  # + the LM head
    assert not any(type(m) is torch.nn.Linear for m in model.module.layers.modules())
    qkv = model.module.layers[0].self_attn.qkv_proj
    assert qkv.bias is not None and qkv.packed.dtype == torch.float32
    ids = [5, 9, 13, 17, 21, 40]
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(model.prompt_logits(ids), want, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("level", bf16_gemm_levels())
def test_bf16_weights_mode_keeps_activations_in_fp32(tiny_models, level):
    """On every level with a native bf16 GEMM (AVX2's widening tile, AVX512-BF16):
    bf16 weights in its pairs, fp32 activations, logits close to the checkpoint's."""
    from engine.models.mixed_precision import Bf16WeightLinear

    path, reference = tiny_models["qwen2"]                 # qkv bias, tied embeddings
    with cpu_isa(level):
        model = load_model(path, dtype="bf16-weights", progress=False)
        projections = [m for m in model.module.modules() if isinstance(m, Bf16WeightLinear)]
        assert len(projections) == 4 * len(model.module.layers)
        assert all(p.packed is not None and p.packed.pairs is not None
                   and p.packed.kernels.isa == level for p in projections)
        assert model.dtype == torch.float32
        assert model.module.embed_tokens.weight.dtype == torch.float32
        ids = [5, 9, 13, 17, 21, 40]
        with torch.inference_mode():
            want = reference(torch.tensor([ids])).logits[0]
        got = model.prompt_logits(ids)
        assert got.dtype == torch.float32
        assert (got - want).abs().max() < 0.05                 # close, not exact: bf16 weights
        assert (got - want).abs().max() > 0                    # and really rounded


def test_bf16_weights_on_dense_weights_is_refused_without_the_native_bf16_gemm(tiny_models):
    """On the generic level (no native bf16 GEMM) an HF checkpoint's bf16 products would
    run at about half float32's rate: refused at load, naming float32."""
    from engine.loading.load_plan import LoadRefused

    path, _ = tiny_models["llama"]
    with cpu_isa("generic"), pytest.raises(LoadRefused, match="generic level.*use dtype float32"):
        load_model(path, dtype="bf16-weights", progress=False)


@pytest.mark.parametrize("dtype,option,expected", [
    pytest.param("bf16-weights", "auto", torch.bfloat16, marks=needs_bf16_gemm),
    pytest.param("bf16-weights", "float32", torch.float32, marks=needs_bf16_gemm),
    ("float32", "auto", torch.float32), ("float32", "bfloat16", torch.bfloat16)])
def test_kv_cache_dtype_option(tiny_models, dtype, option, expected):
    """The cache's element type follows load_model's kv_cache_dtype; a bf16 cache
    changes a chunked prefill's logits (later chunks read the earlier ones' K/V from
    it) by bf16's rounding only."""
    from engine import ContinuousBatchingConfig, GenerationConfig
    from engine.kv_cache.sizing import CacheSizing
    from engine.step.runner import ModelRunner

    path, _ = tiny_models["llama"]
    model = load_model(path, dtype=dtype, progress=False, kv_cache_dtype=option)
    runner = ModelRunner(model.module, CacheSizing(8, 16, 64, 4, 0), seed=0)
    assert runner.cache.key_caches[0].dtype == runner.cache.value_caches[0].dtype == expected
    runner.cache.release()
    if option == "auto":
        return
    exact = load_model(path, dtype=dtype, progress=False, kv_cache_dtype="float32")
    prompt = [[5, 9, 13, 17, 21, 40, 3, 8, 30, 2, 11, 7]]
    chunked = ContinuousBatchingConfig(return_logprobs=True, max_batch_tokens=4)
    first = GenerationConfig(max_new_tokens=1, eos_token_id=[])
    got = list(model.generate_batch(prompt, first, chunked).values())[0].logprobs[0]
    want = list(exact.generate_batch(prompt, first, chunked).values())[0].logprobs[0]
    assert (got == want) == (expected == torch.float32)
    assert abs(got - want) < 0.05


def test_kv_cache_dtype_is_checked():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        load_model("smollm2-135m-instruct", kv_cache_dtype="fp8")


def test_int8_weights_mode_quantizes_projections_and_lm_head(tiny_models):
    from engine import GenerationConfig
    from engine.models.mixed_precision import Int8WeightLinear

    path, reference = tiny_models["llama"]
    model = load_model(path, dtype="int8-weights", progress=False)
    projections = [m for m in model.module.modules() if isinstance(m, Int8WeightLinear)]
    assert len(projections) == 4 * len(model.module.layers) + 1      # + the LM head
    assert all(p.weight_int8.dtype == torch.int8 for p in projections)
    ids = [5, 9, 13, 17, 21, 40]
    with torch.inference_mode():
        want = reference(torch.tensor([ids])).logits[0]
    error = (model.prompt_logits(ids) - want).abs().max()
    assert 0 < error < 0.1                                 # quantized, yet close
    outputs = model.generate_batch([ids, ids[:3]], GenerationConfig(max_new_tokens=5,
                                                                    eos_token_id=[]))
    assert [len(o.generated_tokens) for o in outputs.values()] == [5, 5]


def test_int8_kernel_and_fallback_agree():
    from engine.models.mixed_precision import Int8WeightLinear

    torch.manual_seed(0)
    weight, x = torch.randn(40, 64), torch.randn(5, 64)
    kernel = Int8WeightLinear(weight, None)
    assert kernel.use_kernel
    fallback = Int8WeightLinear(weight, None)
    fallback.use_kernel = False
    fallback.dequantized = (fallback.weight_int8.float() * fallback.scales.float()[:, None]).bfloat16()
    torch.testing.assert_close(kernel(x.bfloat16()).float(), fallback(x.bfloat16()).float(),
                               atol=0.05, rtol=0.02)
    assert (kernel(x).float() - x @ weight.T).abs().max() < 0.2     # close to fp32
    assert not Int8WeightLinear(torch.randn(8, 60), None).use_kernel   # 60 % 16 != 0


def test_packed_linear_equals_nn_linear_with_its_bias():
    from engine.models.packed_linear import PackedLinear

    linear = torch.nn.Linear(64, 48)
    torch.nn.init.normal_(linear.bias)
    packed = PackedLinear.from_weight(linear.weight.detach(), linear.bias.detach())
    x = torch.randn(3, 5, 64)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), atol=1e-5, rtol=1e-4)


def test_metadata_of_deleted_gguf_files_is_forgotten(tmp_path):
    """The cache keeps a GGUF's config and tokenizer (no weights); a folder whose file
    is gone is removed when the next file's metadata is read, and so are the float32
    copies earlier versions kept."""
    import shutil

    from engine.loading.model_files import gguf_metadata_dir, resolve_embedded

    source = resolve_embedded("smollm2-135m-instruct")
    first, second = tmp_path / "first.gguf", tmp_path / "second.gguf"
    shutil.copyfile(source, first)
    stale = tmp_path / "cache" / "gguf" / "model-0123" / "model.safetensors"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(bytes(100))             # an earlier version's float32 copy
    first_dir = gguf_metadata_dir(first, tmp_path / "cache")
    assert not stale.parent.parent.exists()
    assert (first_dir / "config.json").is_file() and not list(first_dir.glob("*.safetensors"))
    first.unlink()
    shutil.copyfile(source, second)
    second_dir = gguf_metadata_dir(second, tmp_path / "cache")
    assert second_dir.is_dir() and not first_dir.exists()


def test_a_hub_gguf_file_offline_gives_a_clear_error(monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelLoadError, match="could not download 'm-Q4_K_M.gguf' from 'nobody/m'"):
        load_model("nobody/m:m-Q4_K_M.gguf")


def test_dtype_auto_is_float32_on_cpu_and_the_checkpoints_half_type_on_gpus():
    import torch
    from transformers import LlamaConfig

    from engine.loading.model_files import auto_dtype

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert auto_dtype(LlamaConfig(dtype="bfloat16"), cpu) == torch.float32
    assert auto_dtype(LlamaConfig(dtype="float16"), cuda) == torch.float16
    assert auto_dtype(LlamaConfig(dtype="bfloat16"), cuda) == torch.bfloat16
    assert auto_dtype(LlamaConfig(dtype="float32"), cuda) == torch.bfloat16
    assert auto_dtype(LlamaConfig(), cuda) == torch.bfloat16
