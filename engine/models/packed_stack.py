"""PackedStack: every decoder layer of a CPU step in one native call.

Steps of 3 rows or more on bf16 weights (bf16-weights, GGUF) otherwise run the layer
loop of packed_layer.py: ~12 kernel calls per layer from Python. That loop's own time,
while the kernels' helper threads spin, was ~15% of a 32-request decode step; and in a
server every return from a kernel waits for the interpreter lock while the event
loop holds it (~360 returns per step of the default model's 30 layers): a thread
busy 8% of the time with Python work slowed a 32-request step by 5-7 ms, a process
equally busy by 2.5-3.5 ms (docs/benchmarks.md). decoder_stack.c runs the same
kernels in the same order for every layer in one call: up to NATIVE_BF16_MAX_ROWS
rows the output is bit-identical to the loop's (tests/engine/test_packed_stack.py).

Past that the loop multiplies on oneDNN (bf16 products, rounded before the fp32
residual stream; the activation a separate pass), while the stack keeps the native
GEMM at any row count: its fp32 sums go to the residual stream as they are and the
gated GEMM writes the activation, so a large prefill is computed more closely to
fp32 and faster: 32 chunks of 67 tokens after a shared 31-token prefix (the c=32
server benchmark's wave), 1,300 -> 1,240 ms (docs/benchmarks.md). It then equals the
loop run with the native GEMM at every size, bit for bit.

It applies when every layer is on the packed-layer path with bf16 weights packed in
pairs (qkv, o, gate/up in the gated layout, down) and the AVX512-BF16 GEMM is built;
per step, when the loop would take the native paths throughout: rows past the block
kernels', fp32 hidden states, the cache layout packed_layer.step_fits accepts, and
the native attention's contexts (decode-only steps: one row per request; steps with
prefill chunks: a row per query, for chunks short enough, batch.STEP_QUERY_MAX_PAIRS).
Otherwise it returns None and the layer loop runs.
"""

from __future__ import annotations

import ctypes
import weakref

import torch
from torch import nn

from .packed_layer import PackedLayer, step_fits


class _Layer(ctypes.Structure):            # decoder_stack.c's StackLayer
    _fields_ = [("input_norm", ctypes.c_void_p), ("post_norm", ctypes.c_void_p),
                ("input_eps", ctypes.c_float), ("post_eps", ctypes.c_float),
                ("qkv", ctypes.c_void_p), ("o", ctypes.c_void_p),
                ("gate_up", ctypes.c_void_p), ("down", ctypes.c_void_p),
                ("keys", ctypes.c_void_p), ("values", ctypes.c_void_p)]


class _Shape(ctypes.Structure):            # decoder_stack.c's StackShape
    _fields_ = [("hidden", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("dim", ctypes.c_int64),
                ("intermediate", ctypes.c_int64), ("num_slots", ctypes.c_int64),
                ("scale", ctypes.c_float), ("kv_bf16", ctypes.c_int)]


def _stackable(packed: PackedLayer) -> bool:
    weights = (packed.qkv, packed.o, packed.gate_up, packed.down)
    return (packed.dtype == torch.bfloat16 and packed.gate_up is not None
            and all(w.pairs is not None for w in weights) and packed.gate_up.gated_inter > 0
            and not any(w.gated_inter for w in (packed.qkv, packed.o, packed.down)))


def _contexts(meta) -> tuple | None:
    """(slots, lengths, slot_rows or None) of the native attention for this step."""
    if not meta.prefills:
        found = (meta.decode_kv_slots, meta.decode_lengths, None)
    else:
        found = (meta.step_kv_slots, meta.step_lengths, meta.step_slot_rows)
    if any(t is None or t.dtype != torch.int64 or not t.is_contiguous() for t in found[:2]):
        return None
    rows = found[2]
    if rows is not None and (rows.dtype != torch.int64 or not rows.is_contiguous()):
        return None
    return found


class PackedStack:
    def __init__(self, layers: list[PackedLayer], kernels) -> None:
        first = layers[0]
        attn = first.attn
        self.kernels, self.function = kernels, kernels.library.bf16_decoder_stack
        self.block_rows = max(layer.block_rows for layer in layers)
        self.layers = (_Layer * len(layers))(*(
            _Layer(layer.first.weight.data_ptr(), layer.second.weight.data_ptr(),
                   layer.first.eps, layer.second.eps, layer.qkv.pairs.data_ptr(),
                   layer.o.pairs.data_ptr(), layer.gate_up.pairs.data_ptr(),
                   layer.down.pairs.data_ptr()) for layer in layers))
        self.packed_layers = layers          # (keeps the weights the pointers point at)
        self.shape = _Shape(first.layer.input_layernorm.weight.shape[0], attn.num_heads,
                            attn.num_kv_heads, attn.head_dim, first.gate_up.gated_inter, 0,
                            attn.scale, 0)
        self.bound = weakref.WeakKeyDictionary()
        """cache -> (layers, shape) pointing at that cache: one pair per cache, so
        engines with caches of their own never share the structures a call reads."""

    @staticmethod
    def build(model: nn.Module, kernels) -> "PackedStack | None":
        """A stack over the model's layers when every one of them qualifies."""
        layers = [getattr(layer, "fast_steps", None) for layer in getattr(model, "layers", [])]
        if (not layers or not kernels.has_bf16_gemm
                or not all(isinstance(p, PackedLayer) and _stackable(p) for p in layers)):
            return None
        return PackedStack(layers, kernels)

    def _bind(self, kv_cache) -> tuple:
        """The layers and shape pointing at `kv_cache`'s tensors (built once per cache)."""
        found = self.bound.get(kv_cache)
        if found is None:
            layers = (_Layer * len(self.layers))(*self.layers)           # copies
            for entry, layer in zip(layers, self.packed_layers):
                entry.keys = kv_cache.key_caches[layer.attn.layer_idx].data_ptr()
                entry.values = kv_cache.value_caches[layer.attn.layer_idx].data_ptr()
            keys = kv_cache.key_caches[0]
            shape = _Shape.from_buffer_copy(self.shape)
            shape.num_slots = keys.shape[0] * keys.shape[1]
            shape.kv_bf16 = int(keys.dtype == torch.bfloat16)
            self.bound[kv_cache] = found = (layers, shape)
        return found

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 kv_cache, meta) -> torch.Tensor | None:
        """The last layer's output [T, hidden], or None when this step is not for it."""
        rows = hidden.shape[0]
        if not (self.block_rows < rows and hidden.dim() == 2
                and hidden.dtype == torch.float32 and hidden.device.type == "cpu"
                and not meta.decode_fast_path and not torch.compiler.is_compiling()):
            return None
        contexts = _contexts(meta)
        key_cache, value_cache = kv_cache.key_caches[0], kv_cache.value_caches[0]
        if contexts is None or not step_fits(meta, cos, sin, key_cache, value_cache):
            return None
        slots, lengths, slot_rows = contexts
        layers, shape = self._bind(kv_cache)
        x = hidden.contiguous().clone()
        status = self.function(
            layers, len(self.packed_layers), ctypes.byref(shape), x.data_ptr(), rows,
            cos.data_ptr(), sin.data_ptr(), meta.slot_mapping.data_ptr(), slots.data_ptr(),
            None if slot_rows is None else slot_rows.data_ptr(), slots.shape[0],
            lengths.data_ptr(), slots.shape[1], self.kernels.num_threads)
        if status:
            raise RuntimeError(f"bf16_decoder_stack failed ({status})")
        return x

