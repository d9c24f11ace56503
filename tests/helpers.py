"""Helpers shared by the tests: tiny model configs and the transformers reference."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

TINY_FAMILIES = ("llama", "qwen2", "qwen3")
SLIDING_WINDOW = 7
"""Window of the tiny sliding-window models (tests/conftest.py)."""


def has_bf16_gemm() -> bool:
    from engine.kernels import load_native_kernels

    kernels = load_native_kernels()
    return kernels is not None and kernels.has_bf16_gemm


def block_kernel_rows() -> int:
    """Up to how many rows this build's block kernels serve a step (kernel_rows)."""
    from engine.kernels import load_native_kernels
    from engine.models.block_weights import kernel_rows

    return kernel_rows(load_native_kernels())


def _packs_bf16() -> bool:
    from engine.models.packed_linear import packing_available

    return packing_available(torch.bfloat16)


needs_bf16_gemm = pytest.mark.skipif(
    not has_bf16_gemm(), reason="the native bf16 GEMM (and the whole-layer stack on it) "
    "needs AVX2 or NEON")
"""For tests of paths that exist only where the native bf16 GEMM is built (PackedStack,
PairedMLP, the paired bf16 layers); everything else they touch runs everywhere."""
def _torch_held() -> str | None:
    from engine.kernels.isa import torch_held_below_cpu

    return torch_held_below_cpu()


needs_torch_at_cpu_level = pytest.mark.skipif(
    _torch_held() is not None, reason="torch is held below this CPU's level "
    "(ATEN_CPU_CAPABILITY, as an emulated AVX2 run sets it): inductor's code disagrees "
    "with ATen's there and compile_paths refuses to compile")
"""For tests that compile layer steps on CPU (an emulated lower level cannot)."""
needs_bf16_packing = pytest.mark.skipif(
    not _packs_bf16(), reason="oneDNN packs bf16 weights only on CPUs with AVX-512 (BW, VL, "
    "DQ) or AVX-NE-CONVERT")
"""For tests of the packed bf16 layers (PackedLayer, packed Bf16 projections)."""


@contextlib.contextmanager
def executors_set_to(module, executors):
    """Run the block with `module`'s executors replaced (models/executors.py): a test's
    spy on a built model, put back after."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module, "executors", executors)
        yield


def stack_of(module, stack_type):
    """The model's whole-stack executor of `stack_type`."""
    return next(s for s in module.executors.stacks if isinstance(s, stack_type))


def layer_executors(module, executor_type) -> list:
    """Each layer's executor of `executor_type`, or None where it has none."""
    return [next((e for e in module.executors.of_layer(i) if isinstance(e, executor_type)), None)
            for i in range(len(module.layers))]


class ServedSpy:
    """An executor that records, per step offered, whether the executor it wraps took
    it (`served`), and the error it raised (`raised`)."""

    def __init__(self, inner) -> None:
        self.inner, self.served, self.raised = inner, [], []

    def fits(self, step) -> bool:
        taken = self.inner.fits(step)
        self.served.append(taken)
        return taken

    def run(self, step):
        try:
            return self.inner.run(step)
        except Exception as error:
            self.raised.append(error)
            raise


def tiny_config(family: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(vocab_size=211, hidden_size=60, intermediate_size=92, num_hidden_layers=3,
                  num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                  rms_norm_eps=1e-6, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if family == "llama":
        return LlamaConfig(**common, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if family == "qwen2":
        return Qwen2Config(**{**common, "tie_word_embeddings": True})
    return Qwen3Config(**common, head_dim=12)


def model_class(family: str):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    return {"llama": LlamaForCausalLM, "qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM}[family]


def save_head16_llama(path, seed: int, max_position_embeddings: int = 512):
    """Save a tiny random Llama with 16-wide heads (the native attention kernel's vector
    path; a head size flash-attn serves) to `path`; returns the transformers model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=211, hidden_size=64, intermediate_size=96,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=max_position_embeddings, rms_norm_eps=1e-6,
                         bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    reference = LlamaForCausalLM(config).eval()
    reference.save_pretrained(path)
    return reference


def random_prompts(count: int, min_len: int, max_len: int, vocab: int = 211, seed: int = 0):
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(min_len, max_len))]
            for _ in range(count)]


@torch.inference_mode()
def reference_greedy(reference, prompt: list[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy generate for one prompt (no EOS stop)."""
    ids = torch.tensor([prompt])
    out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                             max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                             eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def generate_and_inspect(model, prompts, max_new_tokens: int, warmup: bool = False, **config):
    """generate_batch (EOS ignored) with a persistent manager, so that its state can be
    checked afterwards: the allocator invariant holds and every block is free again.
    Returns (generated tokens per prompt, the manager's stats)."""
    from engine import ContinuousBatchingConfig, GenerationConfig

    outputs = model.generate_batch(
        prompts, GenerationConfig(max_new_tokens=max_new_tokens, eos_token_id=[]),
        ContinuousBatchingConfig(**config), persistent_manager=True, warmup=warmup)
    manager = model.kept_manager
    manager.check_invariants()
    stats = manager.stats()
    manager.destroy()
    assert stats["num_free_blocks"] == stats["num_blocks"]
    return [o.generated_tokens for o in outputs.values()], stats


def assert_blocks_decode_like_dense(blocked, dense, max_new_tokens: int) -> None:
    """The same GGUF model loaded with and without its block kernels: three prompts
    decode to the same greedy tokens, logprobs within 3e-4. Both are fp32 products of
    the same weights summed in different orders, and each is that far from the
    truth: on the Qwen2 copy (30 layers, a random qkv bias) teacher-forced in float64,
    torch's dense fp32 path is up to 1.3e-4 off, the AVX2 and AVX-512 block kernels
    3e-5 to 5e-5, the plain C loops 1.8e-4; with torch held to AVX2 as well
    (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA: an AVX2 host) block and dense paths are
    2.0e-4 apart."""
    from engine import ContinuousBatchingConfig, GenerationConfig

    tokenizer = dense.tokenizer
    prompts = [tokenizer.encode(text) for text in ("The capital of France is",
                                                  "def fibonacci(n):", "1, 2, 3, 5, 8,")]
    config = GenerationConfig(max_new_tokens=max_new_tokens)
    logprobs = ContinuousBatchingConfig(return_logprobs=True)
    got = list(blocked.generate_batch(prompts, config, logprobs).values())
    want = list(dense.generate_batch(prompts, config, logprobs).values())
    assert [o.generated_tokens for o in got] == [o.generated_tokens for o in want]
    for mine, reference in zip(got, want):
        assert mine.logprobs == pytest.approx(reference.logprobs, abs=3e-4)


def runnable_isa_levels() -> list[str]:
    """The kernel ISA levels this host can execute, each once: generic, avx2 and
    avx_vnni (x86, where the CPU has them) and the CPU's best (engine/kernels/isa.py),
    for tests run once per variant."""
    from engine.kernels.isa import choose_level, cpu_features

    features = cpu_features()
    names = [choose_level(features, cap).name
             for cap in ("generic", "avx2", "avx_vnni", "native")
             if cap == "native" or cap in _level_names()]
    return list(dict.fromkeys(names))


def bf16_gemm_levels() -> list[str]:
    """The runnable levels whose kernels have a native bf16 GEMM (AVX2 and above)."""
    from engine.kernels import load_native_kernels
    from engine.kernels.isa import machine_levels

    levels = {level.name: level for level in machine_levels()}
    found = []
    for name in runnable_isa_levels():
        kernels = load_native_kernels(level=levels[name]) if name in levels else None
        if kernels is not None and kernels.has_bf16_gemm:
            found.append(name)
    return found


def _level_names() -> list[str]:
    from engine.kernels.isa import machine_levels

    return [level.name for level in machine_levels()]


@contextlib.contextmanager
def cpu_isa(name: str):
    """KVSERVE_CPU_ISA=name while the block runs: models loaded and steps run inside
    it use that level's kernels."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("KVSERVE_CPU_ISA", name)
        yield
