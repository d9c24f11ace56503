"""How llama.cpp stores our families' tensors differently from transformers, undone
as they are read (gguf_checkpoint.py).

    GGUF architecture   what differs
    llama               q and k rows permuted for llama.cpp's RoPE layout (Llama,
                        Mistral, SmolLM2 files): within each head the two halves of
                        the rotated dimensions are interleaved
    gemma3              RMSNorm weights stored as 1 + weight
    qwen2, qwen3        nothing

These are the rules of transformers' GGUF loader, which tests/engine/test_gguf_families.py
checks every parameter against, bit for bit. Families without our code keep using
transformers' processors; ours use these because importing that loader imports every
model package of transformers, a tenth of a 1.7B model's start (docs/benchmarks.md,
"Start-up and real-size models").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Processed:
    """A processed tensor, shaped as transformers' processors return theirs."""

    weights: np.ndarray


class GGUFProcessor:
    """One architecture's processing, with the interface gguf_checkpoint.py calls."""

    def __init__(self, architecture: str, config: dict) -> None:
        self.architecture = architecture
        self.num_heads = config.get("num_attention_heads")
        self.num_kv_heads = config.get("num_key_value_heads") or self.num_heads

    def preprocess_name(self, hf_name: str) -> str:
        return hf_name

    def process(self, weights: np.ndarray, name: str, **_: object) -> Processed:
        """`weights` of the GGUF tensor `name`, as transformers holds them."""
        if self.architecture == "llama" and self.num_heads:
            if ".attn_q." in name:
                weights = _unpermuted(weights, self.num_heads)
            elif ".attn_k." in name:
                weights = _unpermuted(weights, self.num_kv_heads)
        elif self.architecture == "gemma3" and "norm.weight" in name:
            weights = weights - 1
        return Processed(weights)


OWN_PROCESSORS = ("llama", "gemma3", "qwen2", "qwen3")
"""The GGUF architectures GGUFProcessor serves."""


def _unpermuted(weights: np.ndarray, heads: int) -> np.ndarray:
    """Rows [heads * 2 * half, ...] in llama.cpp's order -> transformers' order: the
    file keeps, per head, row pairs (i, half + i) next to each other."""
    half = weights.shape[0] // heads // 2
    grouped = weights.reshape(heads, half, 2, *weights.shape[1:])       # [H, half, 2, ...]
    return grouped.swapaxes(2, 1).reshape(weights.shape)
