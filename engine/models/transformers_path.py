"""Families we have no code for, served by transformers' own modeling code with our
paged attention plugged in through its attention interface.

transformers' decoder layers compute q, k and v, apply their rotary embedding, then
call whichever function `config._attn_implementation` names in
`AttentionInterface`. We register `kvserve_paged` there: it writes the step's k and v
into this layer's pages and attends over the paged cache with the engine's backend,
exactly as our own families' layers do. So continuous batching, the paged cache,
prefix caching, preemption and sliding windows work unchanged; only the layers'
arithmetic is transformers' (no native decode stacks, no GGUF block kernels).

One step is one flat varlen batch: `input_ids` and `positions` [T] go in as a batch
of one row ([1, T]). The step's cache and metadata reach the attention calls through
a thread-local slot set around the forward (not a keyword argument: not every
family's layers pass their keywords on), and transformers builds no mask for an
attention implementation it has no mask function for. Shapes at the seam:

    query [1, H, T, D], key / value [1, KVH, T, D]  (rotated, as transformers hands them)
    -> backend.forward(q [T, H, D], k [T, KVH, D], v [T, KVH, D], ...) -> [T, H, D]
    -> returned as [1, T, H, D], which the layer reshapes to [1, T, H * D]

Families whose attention needs what the backend does not do (logit soft-capping,
attention sinks, per-layer state other than attention) get a clear error.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..attention.backend import AttentionBackend
from ..attention.metadata import AttentionMetadata
from ..model_spec import EngineModelSpec

ATTENTION_NAME = "kvserve_paged"
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention")

UNSUPPORTED_ATTENTION_ARGUMENTS = {"softcap": "attention logit soft-capping",
                                   "s_aux": "attention sinks"}
"""Keywords transformers' layers pass to the attention function that the paged
backend cannot honour (when not None) -> what they are, for the error."""

LOGIT_TRAITS = ("final_logit_softcapping", "logit_scale", "logits_scaling")
"""Config fields by which a family's causal-LM head changes the logits after the LM
head's matmul (Gemma 2's soft-capping, Cohere's scale, Granite's divisor)."""


class UnsupportedModelError(ValueError):
    """The model's architecture cannot run on the paged path."""


@dataclass(frozen=True)
class PagedStep:
    """What the attention calls of one forward need besides their tensors."""

    kv_cache: Any                      # PagedKVCache: key_caches / value_caches per layer
    meta: AttentionMetadata
    backend: Any                       # an attention backend (attention/backend.py)
    layer_is_sliding: list[bool]


@dataclass(frozen=True)
class LayerAttention:
    """What one layer's attention call showed the load-time probe."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    window: int | None | type[Ellipsis]
    """The `sliding_window` keyword it passed: a window, None (full attention), or
    Ellipsis where the layer passes no such keyword."""


class ShapeProbe:
    """Collects a LayerAttention per layer index during one probe forward."""

    def __init__(self) -> None:
        self.layers: dict[int, LayerAttention] = {}


_current = threading.local()
"""`.step`: the PagedStep (or ShapeProbe) of the forward running on this thread.
Thread-local, so engines on other threads never read another's step."""


def paged_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: Any, scaling: float | None = None,
                    dropout: float = 0.0, sliding_window: Any = ...,
                    **kwargs: Any) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature over the paged cache (see the
    module docstring for the shapes). `module` is the calling attention layer; its
    `layer_idx` picks the cache."""
    step = getattr(_current, "step", None)
    for name, what in UNSUPPORTED_ATTENTION_ARGUMENTS.items():
        if kwargs.get(name) is not None:
            raise UnsupportedModelError(f"{type(module).__name__} uses {what}, which the "
                                        "paged attention does not implement")
    layer = module.layer_idx
    if isinstance(step, ShapeProbe):
        step.layers[layer] = LayerAttention(query.shape[1], key.shape[1], key.shape[-1],
                                            sliding_window)
        return torch.zeros_like(query).transpose(1, 2), None
    if step is None:
        raise RuntimeError(f"the {ATTENTION_NAME} attention runs only inside an engine step")
    meta = step.meta.sliding if step.layer_is_sliding[layer] else step.meta
    q = query[0].transpose(0, 1).contiguous()                 # [T, H, D]
    k = key[0].transpose(0, 1).contiguous()                   # [T, KVH, D]
    v = value[0].transpose(0, 1).contiguous()
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = step.backend.forward(q, k, v, step.kv_cache.key_caches[layer],
                               step.kv_cache.value_caches[layer], meta, scale)
    return out.unsqueeze(0), None                             # [1, T, H, D]


@contextlib.contextmanager
def current_step(step: "PagedStep | ShapeProbe"):
    previous = getattr(_current, "step", None)
    _current.step = step
    try:
        yield
    finally:
        _current.step = previous


def register_paged_attention() -> None:
    """Make `kvserve_paged` an attention implementation transformers accepts (once)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)


def check_supported(config: Any) -> None:
    """A clear error for architectures whose layers are not all attention layers
    (state-space and linear-attention hybrids keep state outside the KV cache)."""
    layer_types = getattr(config, "layer_types", None) or []
    others = sorted({t for t in layer_types if t not in ATTENTION_LAYER_TYPES})
    if others:
        raise UnsupportedModelError(
            f"model_type {config.model_type!r} has {', '.join(others)} layers: only attention "
            "layers run on the paged cache")


def probe_layers(backbone: nn.Module, config: Any) -> list[LayerAttention]:
    """One forward of a single token, recording every layer's attention call: the
    cache's shape comes from what the layers really produce, and a family whose
    layers do not all attend through the interface is refused here, not mid-serve."""
    probe = ShapeProbe()
    device = next(backbone.parameters()).device
    token = torch.zeros(1, 1, dtype=torch.long, device=device)
    with torch.inference_mode(), current_step(probe):
        backbone(input_ids=token, position_ids=token, use_cache=False)
    layers = [probe.layers.get(i) for i in range(config.num_hidden_layers)]
    missing = [i for i, layer in enumerate(layers) if layer is None]
    if missing or len(probe.layers) != len(layers):
        raise UnsupportedModelError(
            f"model_type {config.model_type!r}: layers {missing or sorted(probe.layers)} do not "
            "attend through transformers' attention interface, so the paged cache cannot serve them")
    shapes = {(layer.num_kv_heads, layer.head_dim) for layer in layers}
    if len(shapes) != 1:
        raise UnsupportedModelError(f"model_type {config.model_type!r}: layers differ in their "
                                    f"key/value heads and sizes {sorted(shapes)}")
    return layers


def sliding_layers(config: Any, layers: list[LayerAttention]) -> tuple[int | None, list[bool]]:
    """(window, whether each layer slides): from the `sliding_window` each layer's
    attention call passes, else (layers that pass none) from the config, where every
    layer slides when it sets a window (Mistral-style) unless `layer_types` says which."""
    if all(layer.window is Ellipsis for layer in layers):
        window = getattr(config, "sliding_window", None)
        if getattr(config, "use_sliding_window", True) is False:
            window = None
        layer_types = getattr(config, "layer_types", None) or (
            ["sliding_attention"] * len(layers))
        windows = [window if t == "sliding_attention" else None for t in layer_types]
    else:
        windows = [None if layer.window is Ellipsis else layer.window for layer in layers]
    distinct = {int(w) for w in windows if w is not None}
    if len(distinct) > 1:
        raise UnsupportedModelError(f"model_type {config.model_type!r}: sliding windows of "
                                    f"several sizes {sorted(distinct)}")
    return (distinct.pop() if distinct else None), [w is not None for w in windows]


def decoder_layers(backbone: nn.Module, count: int) -> nn.ModuleList:
    """The backbone's list of decoder layers (`layers`, GPT-2's `h`, ...): its one
    ModuleList child of `count` entries."""
    found = [child for child in backbone.children()
             if isinstance(child, nn.ModuleList) and len(child) == count]
    if len(found) != 1:
        raise UnsupportedModelError(f"{type(backbone).__name__}: no single list of {count} "
                                    "decoder layers")
    return found[0]


class TransformersCausalLM(nn.Module):
    """A transformers causal LM behind the engine's model interface: `forward(input_ids,
    positions, kv_cache, meta, backend)` -> final hidden states [T, hidden], `compute_logits`,
    and the cache's shape (`layers`, `num_kv_heads`, `head_dim`, sliding layers)."""

    def __init__(self, hf_model: nn.Module, kv_cache_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        config = hf_model.config
        check_supported(config)
        self.hf = hf_model
        self.config = config
        self.backbone = hf_model.base_model
        self.head = hf_model.get_output_embeddings()
        probed = probe_layers(self.backbone, config)
        self.layers = decoder_layers(self.backbone, len(probed))
        self.num_kv_heads, self.head_dim = probed[0].num_kv_heads, probed[0].head_dim
        self.sliding_window, self.layer_is_sliding = sliding_layers(config, probed)
        self.logit_traits = {name: float(getattr(config, name)) for name in LOGIT_TRAITS
                             if getattr(config, name, None) is not None}
        self.kv_cache_dtype = kv_cache_dtype
        """The KV cache's element type the load plan chose (None: the device's default)."""
        self.tp_group = None
        """Always None: transformers' modeling code is not sharded (load_plan refuses)."""

    def engine_spec(self) -> EngineModelSpec:
        """What the engine needs of this model (model_spec.py); configs name their MLP
        size and context length in many ways, so the ones missing get fallbacks."""
        config = self.config
        intermediate = getattr(config, "intermediate_size", None) or 4 * config.hidden_size
        return EngineModelSpec(
            num_layers=len(self.layers), num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            layer_is_sliding=tuple(self.layer_is_sliding), sliding_window=self.sliding_window,
            kv_cache_dtype=self.kv_cache_dtype, hidden_size=config.hidden_size,
            intermediate_size=intermediate,
            max_context=getattr(config, "max_position_embeddings", None))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache,
                meta: AttentionMetadata, backend: AttentionBackend,
                layer_step=None, executors=None) -> torch.Tensor:
        """input_ids, positions: [T] -> final hidden states [T, hidden], attention by
        `backend` (the runner's). `layer_step` (compiled layer steps) and `executors`
        (native layer paths) do not apply to this path and are ignored."""
        step = PagedStep(kv_cache, meta, backend, self.layer_is_sliding)
        with current_step(step):
            out = self.backbone(input_ids=input_ids[None], position_ids=positions[None],
                                use_cache=False)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab], with the family's logit traits."""
        logits = self.head(hidden)
        cap = self.logit_traits.get("final_logit_softcapping")
        if cap:
            logits = torch.tanh(logits / cap) * cap
        if "logit_scale" in self.logit_traits:
            logits = logits * self.logit_traits["logit_scale"]
        if "logits_scaling" in self.logit_traits:
            logits = logits / self.logit_traits["logits_scaling"]
        return logits.float()



def load_transformers_model(source: Any, dtype: torch.dtype, device: torch.device,
                            kv_cache_dtype: torch.dtype | None) -> TransformersCausalLM:
    """`source`: a model directory, a GGUF file (transformers dequantizes it), or a
    transformers PreTrainedModel (copied, so the caller's model keeps its own
    attention implementation)."""
    import copy

    from transformers import AutoModelForCausalLM

    register_paged_attention()
    if isinstance(source, nn.Module):
        check_supported(source.config)
        hf_model = copy.deepcopy(source).to(device=device, dtype=dtype)
        hf_model.set_attn_implementation(ATTENTION_NAME)
    else:
        where = {"pretrained_model_name_or_path": str(source)} if source.suffix != ".gguf" \
            else {"pretrained_model_name_or_path": str(source.parent), "gguf_file": source.name}
        try:
            hf_model = AutoModelForCausalLM.from_pretrained(
                **where, dtype=dtype, attn_implementation=ATTENTION_NAME).to(device)
        except (ValueError, KeyError) as error:   # no causal-LM class for this config
            raise UnsupportedModelError(f"transformers cannot load {source} as a causal LM: "
                                        f"{error}") from error
    return TransformersCausalLM(hf_model.eval(), kv_cache_dtype)
