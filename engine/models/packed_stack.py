"""PackedStack: every decoder layer of a CPU step in one native call.

Steps of 3 rows or more on bf16 weights (bf16-weights, GGUF) otherwise run the layer
loop of packed_layer.py: ~12 kernel calls per layer from Python. That loop's own time
is spent while the kernels' helper threads spin; and in a server every return from a
kernel waits for the interpreter lock while the event loop holds it (~360 returns per
step of the default model's 30 layers), so any Python work beside the engine slows
every step. decoder_stack.c runs the same kernels in the same order for every layer
in one call: up to NATIVE_BF16_MAX_ROWS rows the output is bit-identical to the
loop's (tests/engine/test_packed_stack.py).

Past that the loop multiplies on oneDNN (bf16 products, rounded before the fp32
residual stream; the activation a separate pass), while the stack keeps the native
GEMM at any row count: its fp32 sums go to the residual stream as they are and the
gated GEMM writes the activation, so a large prefill is computed more closely to
fp32, and faster. It then equals the loop run with the native GEMM at every size,
bit for bit.

Layers it takes: Llama-style ones, Qwen2's (a bias on qkv), Qwen3's (a norm on every
q and k head), Gemma 3's
(those, norms on the attention's and the MLP's outputs, (1 + weight) norms, GELU)
and sliding-window ones (Mistral, Gemma 3's local layers: each layer reads its
attention group's contexts and, for Gemma 3, its own rotary tables), with bf16
weights packed in pairs (qkv, o, gate/up in the gated layout, down), no biases but
qkv's, and the native bf16 GEMM built (AVX512-BF16, or AVX2's widening tile). Models without GGUF blocks (a local directory in
bf16-weights) have no block kernels, so the stack serves their steps from one row
up. Qwen2's, Qwen3's and Mistral's stack equals their loop bit for bit; Gemma 3's loop
runs its (1 + weight) norms and GELU as torch's ops, summed in another order, so there
the two agree to float rounding.

Per step it applies when the loop would take the native paths throughout: rows past
the block kernels', fp32 hidden states, the cache layout packed_layer.step_fits
accepts, and the native attention's contexts for every group (decode-only steps: one
row per request; steps with prefill chunks: a row per query, for chunks short enough,
attention/torch_metadata.STEP_QUERY_MAX_PAIRS, each over its window's part of the context in sliding
layers). Otherwise it returns None and the layer loop runs.
"""

from __future__ import annotations

import ctypes
import weakref

import torch
from torch import nn

from ..attention.metadata import TorchMetadata
from ..kernels.block_layers import LayerTraits
from ..kernels.native import FUSED_ACTIVATIONS, GATED_ACTIVATIONS, kernel_failure
from .block_weights import BlockLinear
from .executors import ModelStep
from .layer_spec import FULL, NativeTraits, native_traits, norms_fit_native
from .packed_layer import packed_of, packed_with_bias, step_fits

class _Layer(ctypes.Structure):            # decoder_stack.c's StackLayer
    _fields_ = [("traits", LayerTraits),
                ("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p),
                ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p),
                ("num_slots", ctypes.c_int64)]


class _Shape(ctypes.Structure):            # decoder_stack.c's StackShape
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("dim", ctypes.c_int64),
                ("intermediate", ctypes.c_int64), ("scale", ctypes.c_float),
                ("kv_bf16", ctypes.c_int), ("activation", ctypes.c_int)]


class _Group(ctypes.Structure):            # decoder_stack.c's StackGroup
    _fields_ = [("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("slot_mapping", ctypes.c_void_p), ("slots", ctypes.c_void_p),
                ("slot_rows", ctypes.c_void_p), ("starts", ctypes.c_void_p),
                ("num_rows", ctypes.c_int64),
                ("lengths", ctypes.c_void_p), ("width", ctypes.c_int64)]


def _weights(layer: nn.Module) -> tuple | None:
    """(qkv, o, gate_up, down) bf16 pairs of a layer the stack can run, or None."""
    attn, mlp = layer.self_attn, layer.mlp
    packed = [packed_with_bias(attn.qkv_proj)[0]] + [
        packed_of(m) for m in (attn.o_proj, mlp.gate_up_proj, mlp.down_proj)]
    if FUSED_ACTIVATIONS.get(layer.spec.activation) is None or any(
            p is None or p.pairs is None or p.dtype != torch.bfloat16 for p in packed):
        return None
    qkv, o, gate_up, down = packed
    if not gate_up.gated_inter or any(p.gated_inter for p in (qkv, o, down)):
        return None
    return qkv, o, gate_up, down


def _describe(layer: nn.Module) -> tuple[_Layer, NativeTraits] | None:
    """The layer's StackLayer (cache fields left for _bind) and the trait tensors it
    points at, or None where the stack cannot run it."""
    weights = _weights(layer)
    if weights is None or not norms_fit_native(layer, layer.spec):
        return None
    traits = native_traits(layer, layer.spec, layer.self_attn.layer_idx)
    qkv, o, gate_up, down = (p.pairs.data_ptr() for p in weights)
    return _Layer(traits=traits.struct, qkv=qkv, o=o, gate_up=gate_up, down=down), traits


def _pointer(tensor: torch.Tensor | None) -> int | None:
    return None if tensor is None else tensor.data_ptr()


def _contexts(meta, rows: int) -> tuple | None:
    """(slots, lengths, slot_rows or None, starts or None) of the native attention for
    this step of one attention group, every per-row tensor `rows` long (None: the
    group has no torch-backend contexts)."""
    if not isinstance(meta, TorchMetadata):
        return None
    if not meta.prefills:
        found = (meta.decode_kv_slots, meta.decode_lengths, None, None)
    else:
        found = (meta.step_kv_slots, meta.step_lengths, meta.step_slot_rows, meta.step_starts)
    slots, lengths, slot_rows, _ = found
    if slots is None or lengths is None or any(
            t is not None and (t.dtype != torch.int64 or not t.is_contiguous()) for t in found):
        return None
    per_row = [t for t in found[1:] if t is not None] + [meta.slot_mapping]
    if any(t.numel() != rows for t in per_row) or (slot_rows is None and slots.shape[0] != rows):
        return None
    return found


class PackedStack:
    """A whole-stack executor (executors.py) on bf16 pairs."""

    def __init__(self, layers: list[nn.Module], described: list, kernels,
                 fast_decode_layers: bool) -> None:
        attn = layers[0].self_attn
        self.kernels, self.function = kernels, kernels.library.bf16_decoder_stack
        block_rows = max(module.max_rows if isinstance(module, BlockLinear) else 0
                         for layer in layers
                         for module in (layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                                        layer.mlp.gate_up_proj, layer.mlp.down_proj))
        self.block_rows = block_rows if fast_decode_layers else 0
        """Steps of at most this many rows are the block kernels' (GGUF models whose
        layers all have a FastDecodeLayer, one native call per step at those rows).
        Layers with blocks but no fast decode path would run those steps in the Python
        layer loop, slower at one row than this stack on bf16 weights (it skips ~12
        calls per layer), so the stack serves them from one row up."""
        self.layers = (_Layer * len(layers))(*(entry for entry, _ in described))
        self.kept = [traits for _, traits in described]      # what the pointers point at
        self.layer_indices = [layer.self_attn.layer_idx for layer in layers]
        self.group_layers: dict[int, int] = {}
        """group -> the layer index of its first layer, whose cache the step checks."""
        for entry, index in zip(self.layers, self.layer_indices):
            self.group_layers.setdefault(entry.traits.group, index)
        gate_up = layers[0].mlp.gate_up_proj.packed
        self.shape = _Shape(layers[0].input_layernorm.weight.shape[0], attn.num_heads,
                            attn.num_kv_heads, attn.head_dim, gate_up.gated_inter, attn.scale,
                            0, GATED_ACTIVATIONS[FUSED_ACTIVATIONS[layers[0].spec.activation]])
        self.bound = weakref.WeakKeyDictionary()
        """cache -> (layers, shape) pointing at that cache: one pair per cache, so
        engines with caches of their own never share the structures a call reads."""

    @staticmethod
    def build(layers: list[nn.Module], kernels, fast_decode_layers: bool) -> "PackedStack | None":
        """A stack over the model's `layers` when every one of them qualifies and they
        share their shapes and attention scale. `fast_decode_layers`: every layer has
        a FastDecodeLayer (the block kernels' steps are theirs)."""
        if not layers or not kernels.has_bf16_gemm:
            return None
        described = [_describe(layer) for layer in layers]
        if any(d is None for d in described):
            return None
        sizes = {(layer.self_attn.num_heads, layer.self_attn.num_kv_heads,
                  layer.self_attn.head_dim, layer.self_attn.scale,
                  layer.mlp.gate_up_proj.packed.gated_inter) for layer in layers}
        if len(sizes) != 1:
            return None
        return PackedStack(layers, described, kernels, fast_decode_layers)

    def _bind(self, kv_cache) -> tuple | None:
        """The layers and shape pointing at `kv_cache`'s tensors (built once per
        cache), or None for caches of mixed dtypes."""
        found = self.bound.get(kv_cache, False)
        if found is False:
            layers = (_Layer * len(self.layers))(*self.layers)           # copies
            dtypes = set()
            for entry, index in zip(layers, self.layer_indices):
                # the layer's own cache (a sliding layer's pool is sized by the same
                # model.layer_is_sliding its group comes from): its slots bound what
                # rope_store may write
                keys, values = kv_cache.key_caches[index], kv_cache.value_caches[index]
                entry.keys, entry.values = keys.data_ptr(), values.data_ptr()
                entry.num_slots = keys.shape[0] * keys.shape[1]
                dtypes |= {keys.dtype, values.dtype}
            shape = _Shape.from_buffer_copy(self.shape)
            shape.kv_bf16 = int(dtypes == {torch.bfloat16})
            found = (layers, shape) if len(dtypes) == 1 else None
            self.bound[kv_cache] = found
        return found

    def _group_views(self, step: ModelStep) -> list | None:
        """(group, metadata, cos, sin, contexts) of each attention group the layers
        read, or None when a group's step is not for the stack (its contexts, rotary
        tables or cache layout are not the native attention's)."""
        views, rows = [], step.hidden.shape[0]
        for group, index in self.group_layers.items():
            group_meta = step.meta if group == FULL else step.meta.sliding
            group_cos, group_sin = (step.cos, step.sin) \
                if group == FULL or step.sliding_rope is None else step.sliding_rope
            contexts = _contexts(group_meta, rows)
            if contexts is None or group_cos.shape[0] != rows or not step_fits(
                    group_meta, group_cos, group_sin, step.kv_cache.key_caches[index],
                    step.kv_cache.value_caches[index]):
                return None
            views.append((group, group_meta, group_cos, group_sin, contexts))
        return views

    def fits(self, step: ModelStep) -> bool:
        """Rows past the block kernels', fp32 CPU hidden states, not a decode fast-path
        or traced step, every group's contexts for the native attention (_group_views)
        and a cache of one dtype."""
        hidden = step.hidden
        return (self.block_rows < hidden.shape[0] and hidden.dim() == 2
                and hidden.dtype == torch.float32 and hidden.device.type == "cpu"
                and not step.meta.decode_fast_path and not torch.compiler.is_compiling()
                and self._group_views(step) is not None
                and self._bind(step.kv_cache) is not None)

    def run(self, step: ModelStep) -> torch.Tensor:
        """The last layer's output [T, hidden]. cos, sin: the rotary tables of the
        full-attention layers (of every layer without `sliding_rope`); sliding_rope:
        Gemma 3's (cos, sin) of its local layers."""
        layers, shape = self._bind(step.kv_cache)
        groups = (_Group * 2)()                  # a group no layer reads stays zero
        for group, meta, cos, sin, (slots, lengths, slot_rows, starts) in self._group_views(step):
            groups[group] = _Group(cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(),
                                   slots.data_ptr(), _pointer(slot_rows), _pointer(starts),
                                   slots.shape[0], lengths.data_ptr(), slots.shape[1])
        x = step.hidden.contiguous().clone()
        status = self.function(layers, len(self.kept), ctypes.byref(shape), x.data_ptr(),
                               x.shape[0], groups, len(groups), self.kernels.num_threads)
        if status:
            raise kernel_failure("bf16_decoder_stack", status)
        return x
