"""Decoder for the Llama family: Llama 2/3, SmolLM2, Mistral, Qwen2 (qkv bias) and
Qwen3 (q/k RMSNorm), with fused QKV and gate/up projections, GQA, RoPE (incl. llama3
scaling) and tied embeddings.

Inputs are one flat varlen step: `input_ids` and `positions` are [T]; the attention
backend reads and writes the paged cache using `meta` (see attention/metadata.py).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..attention.backend import AttentionBackend
from ..attention.metadata import AttentionMetadata
from ..kernels import default_kernels
from ..model_spec import EngineModelSpec
from .classifier_head import classifier_labels
from .executors import Executors, LayerStep, ModelStep, run_layer, run_stack
from .layer_spec import LayerSpec
from .layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary, rope_parameters
from .method_choice import DenseLinear, mlp_path
from .model_parts import ModelParts


def llama_spec(config: Any) -> LayerSpec:
    """The layer traits of the families this file serves, from their config."""
    model_type = config.model_type
    attention_bias = bool(getattr(config, "attention_bias", False))
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None) or (
        ["sliding_attention" if model_type == "mistral" else "full_attention"]
        * config.num_hidden_layers)
    # Mistral: every layer slides; Qwen2 with use_sliding_window: per its layer_types
    sliding = tuple(t == "sliding_attention" and bool(window) for t in layer_types)
    return LayerSpec(qkv_bias=model_type == "qwen2" or attention_bias,
                     o_bias=model_type != "qwen2" and attention_bias,
                     mlp_bias=bool(getattr(config, "mlp_bias", False)),
                     qk_norm=model_type == "qwen3", sandwich_norms=False, norm_offset=0.0,
                     activation=config.hidden_act, layer_is_sliding=sliding,
                     sliding_window=int(window) if any(sliding) else None)


class Attention(nn.Module):
    def __init__(self, config: Any, spec: LayerSpec, layer_idx: int, parts: ModelParts) -> None:
        """This rank's heads (all of them but under tensor parallelism)."""
        super().__init__()
        self.layer_idx = layer_idx
        self.is_sliding = spec.layer_is_sliding[layer_idx]
        heads = config.num_attention_heads
        self.num_heads = heads // parts.tp_size
        self.num_kv_heads = (getattr(config, "num_key_value_heads", None) or heads) // parts.tp_size
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = spec.attention_scale or self.head_dim ** -0.5
        prefix, hidden = f"layers.{layer_idx}.self_attn.", config.hidden_size
        self.qkv_proj = parts.linear(prefix + "qkv_proj", hidden, self.q_size + 2 * self.kv_size,
                                     spec.qkv_bias)
        self.o_proj = parts.linear(prefix + "o_proj", self.q_size, hidden, spec.o_bias)
        self.q_norm, self.k_norm = (
            RMSNorm(self.head_dim, config.rms_norm_eps, spec.norm_offset,
                    parts.tensor(f"{prefix}{name}.weight", (self.head_dim,)))
            if spec.qk_norm else None for name in ("q_norm", "k_norm"))

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor,
                meta: AttentionMetadata, backend) -> torch.Tensor:
        """hidden [T, hidden]; key_cache, value_cache: this layer's pages."""
        num_tokens = hidden.shape[0]
        if self.is_sliding:
            meta = meta.sliding
        qkv = self.qkv_proj(hidden)
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        if self.q_norm is None and native_rope_fits(qkv, cos, sin, key_cache, value_cache, meta):
            return self.o_proj(self.attend_native(qkv, cos, sin, key_cache, value_cache, meta,
                                                  backend, default_kernels()))
        v = qkv[:, self.q_size + self.kv_size:].view(num_tokens, kv_heads, head_dim)
        if self.q_norm is None:        # rotate q and k together: [T, H + KVH, D]
            qk = qkv[:, :self.q_size + self.kv_size].view(num_tokens, heads + kv_heads, head_dim)
            q, k = apply_rotary(qk, cos, sin).split([heads, kv_heads], dim=1)
        else:
            q, k = qkv[:, :self.q_size + self.kv_size].split([self.q_size, self.kv_size], dim=-1)
            q = self.q_norm(q.reshape(num_tokens, heads, head_dim))       # [T, H, D]
            k = self.k_norm(k.reshape(num_tokens, kv_heads, head_dim))    # [T, KVH, D]
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = backend.forward(q, k, v, key_cache, value_cache, meta, self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


    def attend_native(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      key_cache: torch.Tensor, value_cache: torch.Tensor,
                      meta: AttentionMetadata, backend, kernels) -> torch.Tensor:
        """qkv [T, (H + 2 KVH) * D] fp32 -> attention output [T, H * D]: one native call
        rotates q and k in place and writes k, v to the cache, then the backend attends
        (the caller checked native_rope_fits)."""
        num_tokens, heads, kv_heads = qkv.shape[0], self.num_heads, self.num_kv_heads
        kernels.rope_store(qkv, heads, cos, sin, meta.slot_mapping,
                           key_cache.view(-1, kv_heads, self.head_dim),
                           value_cache.view(-1, kv_heads, self.head_dim))
        q, k, v = qkv.view(num_tokens, heads + 2 * kv_heads, self.head_dim).split(
            [heads, kv_heads, kv_heads], dim=1)
        out = backend.forward(q, k, v, key_cache, value_cache, meta, self.scale,
                              cache_written=True)
        return out.reshape(num_tokens, self.q_size)


def native_rope_fits(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     key_cache: torch.Tensor, value_cache: torch.Tensor,
                     meta: AttentionMetadata) -> bool:
    """Whether this step's RoPE and cache write can be the native call: contiguous CPU
    fp32 tensors (the cache fp32 or bf16), the rotation over the whole head, and
    kernels built."""
    return (qkv.dtype == cos.dtype == sin.dtype == torch.float32 and qkv.device.type == "cpu"
            and qkv.dim() == 2 and qkv.is_contiguous()
            and cos.shape == sin.shape == (qkv.shape[0], key_cache.shape[-1])
            and cos.is_contiguous() and sin.is_contiguous()
            and key_cache.dtype == value_cache.dtype
            and key_cache.dtype in (torch.float32, torch.bfloat16)
            and key_cache.is_contiguous() and value_cache.is_contiguous()
            and meta.slot_mapping.dtype == torch.int64 and meta.slot_mapping.is_contiguous()
            and default_kernels() is not None)


def layer_norm(config: Any, spec: LayerSpec, parts: ModelParts, name: str) -> RMSNorm:
    """A norm over the hidden size: the model's final one, or a layer's (`name`
    `layers.0.input_layernorm`)."""
    return RMSNorm(config.hidden_size, config.rms_norm_eps, spec.norm_offset,
                   parts.tensor(name + ".weight", (config.hidden_size,)))


def gated_mlp(config: Any, spec: LayerSpec, parts: ModelParts, layer_idx: int) -> GatedMLP:
    """Layer `layer_idx`'s MLP (this rank's share of it), with its native path."""
    prefix, hidden = f"layers.{layer_idx}.mlp.", config.hidden_size
    inter = config.intermediate_size // parts.tp_size
    gate_up = parts.linear(prefix + "gate_up_proj", hidden, 2 * inter, spec.mlp_bias)
    down = parts.linear(prefix + "down_proj", inter, hidden, spec.mlp_bias)
    return GatedMLP(gate_up, down, spec.activation,
                    mlp_path(gate_up, down, spec.activation, parts.plan))


class DecoderLayer(nn.Module):
    def __init__(self, config: Any, spec: LayerSpec, layer_idx: int, parts: ModelParts) -> None:
        super().__init__()
        self.spec = spec
        self.is_sliding = spec.layer_is_sliding[layer_idx]
        prefix = f"layers.{layer_idx}."
        self.input_layernorm = layer_norm(config, spec, parts, prefix + "input_layernorm")
        self.self_attn = Attention(config, spec, layer_idx, parts)
        self.post_attention_layernorm = layer_norm(config, spec, parts,
                                                   prefix + "post_attention_layernorm")
        self.mlp = gated_mlp(config, spec, parts, layer_idx)

    def forward(self, hidden, cos, sin, kv_cache, meta, backend, layer_step=None,
                executors: tuple = ()):
        """`layer_step`: a compiled `torch_step` (compile_paths.py) that replaces the
        executors and the modules' eager path for this step, or None. `executors`:
        this layer's (executors.py), tried before the modules."""
        key_cache = kv_cache.key_caches[self.self_attn.layer_idx]
        value_cache = kv_cache.value_caches[self.self_attn.layer_idx]
        if layer_step is not None:
            return layer_step(self, hidden, cos, sin, key_cache, value_cache, meta, backend)
        if executors:
            out = run_layer(executors, LayerStep(hidden, cos, sin, kv_cache, meta, backend))
            if out is not None:
                return out
        return self.torch_step(hidden, cos, sin, key_cache, value_cache, meta, backend)

    def torch_step(self, hidden, cos, sin, key_cache, value_cache, meta, backend):
        """The layer through its modules. It reads no layer index (its caches come in
        as arguments), so one compiled copy serves every layer of the model."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin,
                                         key_cache, value_cache, meta, backend)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaFamilyForCausalLM(nn.Module):
    def __init__(self, config: Any, parts: ModelParts) -> None:
        """Built whole from `parts` (model_parts.py): the checkpoint's tensors in the
        load plan's linear methods, the KV cache dtype, the tensor-parallel group, the
        layer executors. Nothing changes a built model."""
        super().__init__()
        self.config = config
        self.spec = llama_spec(config)
        hidden, vocab = config.hidden_size, config.vocab_size
        self.embed_tokens = parts.embedding(vocab, hidden)
        self.layers = nn.ModuleList(
            DecoderLayer(config, self.spec, i, parts) for i in range(config.num_hidden_layers))
        self.norm = layer_norm(config, self.spec, parts, "norm")
        self.num_labels = classifier_labels(config)
        self.score = None if self.num_labels is None else DenseLinear(
            parts.tensor("score.weight", (self.num_labels, hidden)), None)
        """A sequence-classification checkpoint's head (classifier_head.py), else None."""
        tied = bool(getattr(config, "tie_word_embeddings", False)) or self.score is not None
        self.lm_head = parts.lm_head(self.embed_tokens, hidden, vocab, tied)
        """The head's linear method (method_choice.py); None: the logits multiply the
        embedding table (a tied head kept dense and unpacked, or a classifier, whose
        logits serve the warmup only: the manager refuses its generating requests)."""
        head_dim = self.layers[0].self_attn.head_dim
        self.rotary = RotaryEmbedding(head_dim, rope_parameters(config), config,
                                      parts.tensors.device)
        self.init_common(parts)

    def init_common(self, parts: ModelParts) -> None:
        """What every family of ours sets up alike, last (after self.spec, the layers
        and the head)."""
        self.sliding_window = self.spec.sliding_window
        self.layer_is_sliding = list(self.spec.layer_is_sliding)
        self.kv_cache_dtype = parts.kv_cache_dtype
        """The KV cache's element type the load plan chose (None: the device's default)."""
        self.tp_group = parts.tp_group
        """TensorParallelGroup when the weights are sharded over torchrun ranks."""
        self.executors = parts.executors(self)
        """How steps may run besides the modules (executors.py, executor_choice.py)."""

    def engine_spec(self) -> EngineModelSpec:
        """What the engine needs of this model (model_spec.py)."""
        config = self.config
        return EngineModelSpec(
            num_layers=len(self.layers), num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            layer_is_sliding=tuple(self.layer_is_sliding), sliding_window=self.sliding_window,
            kv_cache_dtype=self.kv_cache_dtype, hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            max_context=config.max_position_embeddings, num_labels=self.num_labels)

    @property
    def num_kv_heads(self) -> int:
        return self.layers[0].self_attn.num_kv_heads

    @property
    def head_dim(self) -> int:
        return self.layers[0].self_attn.head_dim

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[T] -> the step's first hidden states [T, hidden]."""
        return self.embed_tokens(input_ids)

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple:
        """(cos, sin) of the full-attention layers and of the sliding ones (None: the
        same tables serve both), each [T, head_dim]."""
        return self.rotary(positions, dtype), None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache,
                meta: AttentionMetadata, backend: AttentionBackend,
                layer_step=None, executors: Executors | None = None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden], attention by
        `backend` (the runner's). `layer_step`: see DecoderLayer.forward. The whole
        stack's executor runs first where one serves the step, else layer by layer.
        `executors`: in place of the model's own (a runner's, e.g. bench.step's layer
        loop), or None."""
        hidden = self.embed(input_ids)
        full, sliding = self.rope_tables(positions, hidden.dtype)
        executors = self.executors if executors is None else executors
        if executors.stacks and layer_step is None and backend.name == "torch":
            out = run_stack(executors, ModelStep(hidden, *full, kv_cache, meta,
                                                 sliding_rope=sliding))
            if out is not None:
                return self.norm(out)
        for i, layer in enumerate(self.layers):
            cos, sin = sliding if sliding is not None and layer.is_sliding else full
            hidden = layer(hidden, cos, sin, kv_cache, meta, backend, layer_step,
                           executors.of_layer(i))
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab]."""
        if self.lm_head is None:
            return torch.nn.functional.linear(hidden, self.embed_tokens.weight).float()
        return self.lm_head(hidden).float()

    def compute_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 classification logits [N, num_labels] (classifiers only)."""
        return self.score(hidden).float()
