"""What the engine needs to know of a model, declared once by the model.

The engine sizes the KV cache, lays out its pages, splits layers into attention groups
and chooses its decode paths from a handful of facts about the model. Each model
class the engine serves (our families in models/llama.py and models/gemma3.py,
transformers' models behind models/transformers_path.py) states them in one frozen
EngineModelSpec, `module.engine_spec()`, which the manager's parts read when they
are built (engine_setup.py, runner.py, feature_gates.py, attention/backend.py):
nothing in the engine probes a model for optional attributes.

    spec = module.engine_spec()
    spec.kv_dtype(device, activations)   # the cache's element type
    spec.pooled_sliding                  # sliding layers recycle pages in their own pool

The model's own interface (forward, compute_logits, the attention backend it calls)
is EngineModule below.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class EngineModelSpec:
    """`layer_is_sliding[i]`: layer i attends to the last `sliding_window` positions
    only (None: no sliding layers). `kv_cache_dtype`: the cache's element type the
    load chose (None: the device's default, see kv_dtype). `hidden_size`,
    `intermediate_size`: the activations' sizes, for the cache's memory budget;
    `max_context`: the model's longest context (None: unbounded). `num_labels`: the
    labels of a sequence-classification checkpoint's head (classifier_head.py); such
    a model has no LM head and serves classifying pooling requests (None: a causal
    LM)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    layer_is_sliding: tuple[bool, ...]
    sliding_window: int | None
    kv_cache_dtype: torch.dtype | None
    hidden_size: int
    intermediate_size: int
    max_context: int | None = None
    num_labels: int | None = None

    def __post_init__(self) -> None:
        for name, value in (("num_layers", self.num_layers),
                            ("num_kv_heads", self.num_kv_heads), ("head_dim", self.head_dim),
                            ("hidden_size", self.hidden_size),
                            ("intermediate_size", self.intermediate_size)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineModelSpec.{name} must be a positive integer, "
                                 f"got {value!r}")
        if len(self.layer_is_sliding) != self.num_layers:
            raise ValueError(f"EngineModelSpec.layer_is_sliding has "
                             f"{len(self.layer_is_sliding)} entries for {self.num_layers} "
                             f"layers")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"EngineModelSpec.sliding_window must be positive or None, got "
                             f"{self.sliding_window!r}")
        if any(self.layer_is_sliding) and self.sliding_window is None:
            raise ValueError("EngineModelSpec.sliding_window: sliding layers need a window")
        if self.num_labels is not None and self.num_labels < 1:
            raise ValueError(f"EngineModelSpec.num_labels must be positive or None, got "
                             f"{self.num_labels!r}")
        if self.max_context is not None and self.max_context < 1:
            raise ValueError(f"EngineModelSpec.max_context must be positive or None, got "
                             f"{self.max_context!r}")

    @property
    def pooled_sliding(self) -> bool:
        """Sliding layers get a page pool of their own, recycled past the window."""
        return self.sliding_window is not None and any(self.layer_is_sliding)

    @property
    def has_full_layers(self) -> bool:
        return not all(self.layer_is_sliding)

    def kv_dtype(self, device: torch.device, activations: torch.dtype) -> torch.dtype:
        """The KV cache's element type on `device` for a model computing in
        `activations` (kv_cache/paged_cache.py's rule)."""
        from .kv_cache.paged_cache import kv_cache_dtype

        return kv_cache_dtype(device, activations, self.kv_cache_dtype)

    def kv_bytes_per_token(self, kv_dtype: torch.dtype) -> int:
        """Bytes one position takes in one layer's K and V, in elements of `kv_dtype`."""
        element = torch.empty((), dtype=kv_dtype).element_size()
        return 2 * self.num_kv_heads * self.head_dim * element


class EngineModule(Protocol):
    """The model interface the engine calls (an nn.Module): its decoder `layers` (one
    KV cache layer each), its spec, the forward pass (attention by the backend the
    runner passes in) and the logits (or a classifier's scores)."""

    layers: object

    def engine_spec(self) -> EngineModelSpec:
        ...

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache,
                meta, backend, layer_step=None, executors=None) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden], attention by
        `backend`; `layer_step` and `executors`: the runner's, where it has them."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 logits [N, vocab]."""
        ...

    def compute_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden] -> fp32 classification logits [N, num_labels]; only models whose
        spec has num_labels."""
        ...
