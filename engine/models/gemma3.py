"""Decoder for Gemma 3 text models: a pattern of sliding-window and full-attention
layers with their own RoPE bases, q/k RMSNorm, Gemma's (1 + weight) norms around both
the attention and the MLP, embeddings scaled by sqrt(hidden_size), and attention
scaled by query_pre_attn_scalar ** -0.5.

Inputs are one flat varlen step, as in llama.py; sliding layers read `meta.sliding`.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from .layer_spec import LayerSpec
from .layers import RotaryEmbedding, rope_parameters
from .llama import Attention, DecoderLayer, LlamaFamilyForCausalLM, gated_mlp, layer_norm
from .model_parts import ModelParts

SLIDING, FULL = "sliding_attention", "full_attention"


def gemma3_spec(config: Any) -> LayerSpec:
    """Gemma 3's layer traits: q/k head norms, sandwich norms, (1 + weight) norms,
    GELU (tanh), and its pattern of sliding layers."""
    if getattr(config, "attn_logit_softcapping", None) is not None:
        raise ValueError("attn_logit_softcapping is not supported")
    bias = bool(getattr(config, "attention_bias", False))
    sliding = tuple(t == SLIDING for t in config.layer_types)
    return LayerSpec(qkv_bias=bias, o_bias=bias, mlp_bias=False, qk_norm=True,
                     sandwich_norms=True, norm_offset=1.0,
                     attention_scale=config.query_pre_attn_scalar ** -0.5,
                     activation=config.hidden_activation, layer_is_sliding=sliding,
                     sliding_window=int(config.sliding_window) if any(sliding) else None)


def layer_rope_parameters(config: Any, layer_type: str) -> dict:
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params:
        merged = dict(params[layer_type])
        merged.setdefault("rope_type", "default")
        return merged
    merged = rope_parameters(config)        # older configs: rope_theta + rope_local_base_freq
    if layer_type == SLIDING:
        merged = {"rope_type": "default",
                  "rope_theta": getattr(config, "rope_local_base_freq", 10000.0)}
    return merged


class Gemma3DecoderLayer(DecoderLayer):
    """Llama's layer dispatch (DecoderLayer.forward) over Gemma's modules."""

    def __init__(self, config: Any, spec: LayerSpec, layer_idx: int, parts: ModelParts) -> None:
        nn.Module.__init__(self)
        self.spec = spec
        self.is_sliding = spec.layer_is_sliding[layer_idx]
        self.self_attn = Attention(config, spec, layer_idx, parts)
        self.mlp = gated_mlp(config, spec, parts, layer_idx)
        for name in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):
            self.add_module(name, layer_norm(config, spec, parts, f"layers.{layer_idx}.{name}"))

    def torch_step(self, hidden, cos, sin, key_cache, value_cache, meta, backend):
        """The layer through its modules; reads no layer index, so one compiled copy
        serves every layer (sliding and full ones differ in `is_sliding` only)."""
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, key_cache, value_cache,
                              meta, backend)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3ForCausalLM(LlamaFamilyForCausalLM):
    """Shares weight loading and logits with the Llama family; differs in layers."""

    def __init__(self, config: Any, parts: ModelParts) -> None:
        nn.Module.__init__(self)
        self.config = config
        self.spec = gemma3_spec(config)
        hidden, vocab = config.hidden_size, config.vocab_size
        self.embed_tokens = parts.embedding(vocab, hidden)
        self.embed_scale = hidden ** 0.5
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, self.spec, i, parts)
                                    for i in range(config.num_hidden_layers))
        self.norm = layer_norm(config, self.spec, parts, "norm")
        tied = bool(getattr(config, "tie_word_embeddings", True))
        self.lm_head = parts.lm_head(self.embed_tokens, hidden, vocab, tied)
        self.num_labels, self.score = None, None   # no classifier checkpoints (classifier_head.py)
        self.final_logit_softcapping = getattr(config, "final_logit_softcapping", None)
        self.rotaries = nn.ModuleDict({
            kind: RotaryEmbedding(config.head_dim, layer_rope_parameters(config, kind), config,
                                  parts.tensors.device)
            for kind in (SLIDING, FULL)})
        self.init_common(parts)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(self.embed_scale).to(hidden.dtype)   # as transformers rounds it

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
        """Full and sliding layers rotate with their own bases."""
        return (self.rotaries[FULL](positions, dtype), self.rotaries[SLIDING](positions, dtype))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        if self.final_logit_softcapping is not None:
            cap = self.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits
