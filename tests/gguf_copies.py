"""GGUF copies of the default model with its layers' weights re-quantized or its
architecture changed, for the tests of block kinds and families no packaged file
holds (Q5_1, Q5_K, Q8_0, mixtures of kinds within a layer and within one fused
projection, as Q4_K_M and Q5_K_M files have; Qwen2 and Qwen3 layers).

`write_requantized` copies every metadata field and tensor of a GGUF file, passing
each attention and MLP weight (dequantized by gguf-py) through a choice of encoding.
`write_as_qwen2` copies it as a Qwen2 model instead: the same blocks, q and k in the
order Qwen2 files keep them, and a bias on q, k and v. `write_tiny_qwen3` writes a
small random Qwen3 model (q and k head norms) with the default model's tokenizer.
gguf-py quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0 but only dequantizes the K types,
so `quantize_q5_k` here writes Q5_K itself.
"""

from __future__ import annotations

import collections
import re
from typing import Callable

import numpy as np

from bench.random_gguf import write_tensors

Encode = Callable[[str, int, np.ndarray], tuple[np.ndarray, object]]
"""(tensor name, layer index, fp32 weights [rows, K]) -> (GGUF bytes, quantization type)."""


def quantize_q5_k(weights: np.ndarray) -> np.ndarray:
    """fp32 [rows, K] (K a multiple of 256) -> Q5_K bytes [rows, K / 256 * 176]: per
    32 weights a 6-bit scale and minimum under the super-block's fp16 d and dmin,
    codes 0..31 (round to nearest; not llama.cpp's search, just a valid encoding)."""
    rows = weights.shape[0]
    w = weights.reshape(rows, -1, 8, 32).astype(np.float32)          # [R, S, sub, 32]
    low, high = np.minimum(w.min(-1), 0.0), w.max(-1)
    step, floor = np.maximum(high - low, 1e-8) / 31, -low               # [R, S, 8]
    d = (step.max(-1) / 63).astype(np.float16)
    dmin = np.maximum(floor.max(-1) / 63, 1e-8).astype(np.float16)
    sc = np.clip(np.rint(step / d[..., None].astype(np.float32)), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(floor / dmin[..., None].astype(np.float32)), 0, 63).astype(np.uint8)
    scale = d[..., None].astype(np.float32) * sc
    minimum = dmin[..., None].astype(np.float32) * mn
    q = np.clip(np.rint((w + minimum[..., None]) / scale[..., None]), 0, 31).astype(np.uint8)
    packed = np.concatenate([sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
                             mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
                             (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], axis=-1)
    pairs = q.reshape(rows, -1, 4, 2, 32)                             # chunk c, half h
    codes = (pairs[:, :, :, 0] & 15) | ((pairs[:, :, :, 1] & 15) << 4)  # [R, S, 4, 32]
    bits = (pairs >> 4) << np.arange(8, dtype=np.uint8).reshape(4, 2, 1)   # bit 2c + h
    fifth = np.bitwise_or.reduce(bits.reshape(rows, -1, 8, 32), axis=2)  # [R, S, 32]
    blocks = np.concatenate([d[..., None].view(np.uint8), dmin[..., None].view(np.uint8),
                             packed, fifth, codes.reshape(rows, -1, 128)], axis=-1)
    return blocks.reshape(rows, -1)


def _copy_fields(reader, target, arch: str, rename: Callable[[str], str] = str,
                 keep: Callable[[str], bool] = lambda name: True):
    """A GGUFWriter for `target` holding the metadata fields of `reader` that `keep`
    (under rename(name)), its architecture `arch`."""
    import gguf

    writer = gguf.GGUFWriter(target, arch)
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF.") \
                or not keep(field.name):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(rename(field.name), field.contents(), value_type,
                             sub_type=sub_type)
    return writer


def write_requantized(source, target, encode: Encode) -> collections.Counter:
    """The GGUF file at `source` copied to `target` with every attention and MLP
    weight of its layers re-encoded by `encode`; returns the count of each type written."""
    import gguf
    from gguf import GGMLQuantizationType as Type, quants

    reader = gguf.GGUFReader(source)
    writer = _copy_fields(reader, target, reader.fields["general.architecture"].contents())
    tensors, written = [], collections.Counter()
    for tensor in reader.tensors:
        data, kind = tensor.data, tensor.tensor_type
        layer = re.match(r"blk\.(\d+)\.", tensor.name)
        if layer and any(part in tensor.name for part in ("attn_", "ffn_")) and data.ndim == 2 \
                and kind not in (Type.F32, Type.F16):
            data, kind = encode(tensor.name, int(layer.group(1)), quants.dequantize(data, kind))
        written[kind.name] += 1
        tensors.append((tensor.name, data, kind))
    write_tensors(writer, tensors)
    return written


def _unpermuted(rows: np.ndarray, num_heads: int) -> np.ndarray:
    """q or k rows (any per-row encoding) from llama.cpp's RoPE order back to the
    model's, as transformers' GGUF loader reorders Llama files (Qwen2 files are not
    reordered)."""
    dim = rows.shape[0] // num_heads // 2
    index = np.arange(rows.shape[0]).reshape(num_heads, dim, 2).swapaxes(1, 2).reshape(-1)
    return rows[index]


def write_as_qwen2(source, target, seed: int = 0, bias_scale: float = 0.5) -> int:
    """The Llama GGUF file at `source` copied to `target` as a Qwen2 model: "llama."
    keys renamed "qwen2.", q and k rows in the model's order, and fp32 biases on q, k
    and v (normal, `bias_scale` standard deviation, from `seed`). Returns the biases
    written. Its dense weights are the source's plus the biases."""
    import gguf
    from gguf import GGMLQuantizationType as Type

    reader = gguf.GGUFReader(source)
    writer = _copy_fields(reader, target, "qwen2", lambda name: re.sub(r"^llama\.", "qwen2.", name))
    heads = {count: int(reader.fields[f"llama.attention.{count}"].contents())
             for count in ("head_count", "head_count_kv")}
    generator = np.random.default_rng(seed)
    tensors = []
    for tensor in reader.tensors:
        data = tensor.data
        for part, count in (("attn_q.weight", "head_count"), ("attn_k.weight", "head_count_kv")):
            if tensor.name.endswith(part):
                data = _unpermuted(data, heads[count])
        tensors.append((tensor.name, data, tensor.tensor_type))
        if re.search(r"\.attn_[qkv]\.weight$", tensor.name):
            rows = int(tensor.shape[-1])                  # GGUF shapes: [K, rows]
            bias = (generator.standard_normal(rows) * bias_scale).astype(np.float32)
            tensors.append((tensor.name.replace(".weight", ".bias"), bias, Type.F32))
    write_tensors(writer, tensors)
    return sum(name.endswith(".bias") for name, _, _ in tensors)


TINY_QWEN3 = {"embedding_length": 256, "feed_forward_length": 512, "block_count": 2,
              "attention.head_count": 4, "attention.head_count_kv": 2}
"""The tiny Qwen3's shape: heads of 128 (transformers' Qwen3 default, which its GGUF
reader keeps: the file has no key for it), so q and the attention output are 512
wide beside a hidden size of 256."""

TINY_GEMMA3 = {"embedding_length": 128, "feed_forward_length": 256, "block_count": 6,
               "attention.head_count": 2, "attention.head_count_kv": 1,
               "attention.key_length": 64, "attention.value_length": 64,
               "attention.sliding_window": 8}
"""The tiny Gemma 3's shape: Gemma 3's pattern of five sliding layers to one full
one, a window of 8 tokens, heads of 64."""

GEMMA3_VOCAB = 4096
"""The tiny Gemma 3 keeps the first 4,096 tokens of Gemma 3's vocabulary (its special
and byte tokens among them)."""


def write_tiny_qwen3(source, target, seed: int = 0, kind: str = "Q4_1") -> None:
    """A random 2-layer Qwen3 model (TINY_QWEN3; RMSNorms of every q and k head) at
    `target`, its projections in `kind`, its embeddings in Q8_0 and tied, with the
    tokenizer and chat template of the GGUF file at `source`. Weights are normal with
    standard deviation 0.15, norms near 1, so its logits spread as a trained model's."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = _copy_fields(reader, target, "qwen3", keep=lambda name: name.startswith(
        "tokenizer.") or name == "general.name")
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    _write_random_model(writer, "qwen3", dict(TINY_QWEN3, vocab_size=vocab), 128,
                        ("attn_norm", "ffn_norm"), kind, np.random.default_rng(seed))


def write_tiny_gemma3(source, target, seed: int = 0, kind: str = "Q4_1") -> None:
    """A random 6-layer Gemma 3 model (TINY_GEMMA3: norms on the attention's and the
    MLP's outputs, q and k head norms, GELU-tanh, sliding and full layers) at
    `target`, its projections in `kind`, its embeddings in Q8_0 and tied, with the
    first GEMMA3_VOCAB tokens of the Gemma 3 GGUF file at `source`. Its norms hold
    values near 1, as Gemma files hold 1 + weight (transformers' reader subtracts the
    1 again)."""
    import gguf

    reader = gguf.GGUFReader(source)
    writer = gguf.GGUFWriter(target, "gemma3")
    for field in reader.fields.values():
        if field.name.startswith("tokenizer.ggml."):
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            value = field.contents()
            writer.add_key_value(field.name, value[:GEMMA3_VOCAB] if sub_type else value,
                                 value_type, sub_type=sub_type)
    norms = ("attn_norm", "ffn_norm", "post_attention_norm", "post_ffw_norm")
    _write_random_model(writer, "gemma3", dict(TINY_GEMMA3, vocab_size=GEMMA3_VOCAB), 64,
                        norms, kind, np.random.default_rng(seed))


def _write_random_model(writer, arch: str, shape: dict, dim: int, layer_norms: tuple,
                        kind: str, generator) -> None:
    """The shape's keys under `arch`, then random weights (normal, standard deviation
    0.15; norms 1 plus normal values of standard deviation 0.1; q and k head norms of
    `dim`) into `writer`, which is closed."""
    from gguf import GGMLQuantizationType as Type

    vocab = shape.pop("vocab_size")
    for key, value in dict(shape, context_length=4096, vocab_size=vocab).items():
        writer.add_uint32(f"{arch}.{key}", value)
    writer.add_float32(f"{arch}.rope.freq_base", 1_000_000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    hidden, inter = shape["embedding_length"], shape["feed_forward_length"]
    heads, kv_heads = shape["attention.head_count"], shape["attention.head_count_kv"]

    def weights(rows: int, cols: int) -> np.ndarray:
        return (generator.standard_normal((rows, cols)) * 0.15).astype(np.float32)

    def norm(size: int) -> np.ndarray:
        return (1.0 + generator.standard_normal(size) * 0.1).astype(np.float32)

    tensors = [("token_embd.weight", *quantized(weights(vocab, hidden), "Q8_0")),
               ("output_norm.weight", norm(hidden), Type.F32)]
    for layer in range(shape["block_count"]):
        blk = f"blk.{layer}."
        tensors += [(blk + name + ".weight", norm(hidden), Type.F32) for name in layer_norms]
        tensors += [(blk + "attn_q_norm.weight", norm(dim), Type.F32),
                    (blk + "attn_k_norm.weight", norm(dim), Type.F32)]
        for name, rows, cols in (("attn_q", heads * dim, hidden),
                                 ("attn_k", kv_heads * dim, hidden),
                                 ("attn_v", kv_heads * dim, hidden),
                                 ("attn_output", hidden, heads * dim), ("ffn_gate", inter, hidden),
                                 ("ffn_up", inter, hidden), ("ffn_down", hidden, inter)):
            tensors.append((blk + name + ".weight", *quantized(weights(rows, cols), kind)))
    write_tensors(writer, tensors)


def quantized(weights: np.ndarray, kind_name: str) -> tuple[np.ndarray, object]:
    """gguf-py's encoding of `weights` in the named type, or quantize_q5_k's for Q5_K."""
    from gguf import GGMLQuantizationType as Type, quants

    if kind_name == "Q5_K":
        return quantize_q5_k(weights), Type.Q5_K
    return quants.quantize(weights, Type[kind_name]), Type[kind_name]


def q5_encoding(name: str, layer: int, weights: np.ndarray):
    """Q5_K for rows of whole 256-weight super-blocks (the down projections), Q5_1 else."""
    return quantized(weights, "Q5_K" if weights.shape[1] % 256 == 0 else "Q5_1")


MIXED_KINDS = {"attn_q": "Q4_1", "attn_k": "Q4_1", "attn_v": "Q8_0", "attn_output": "Q5_1",
               "ffn_gate": ("Q8_0", "Q4_1"), "ffn_up": ("Q8_0", "Q4_1"),
               "ffn_down": ("Q5_K", "Q8_0")}
"""Each weight's type in `mixed_encoding`; pairs are (even layers, odd layers)."""


def mixed_encoding(name: str, layer: int, weights: np.ndarray):
    """Every kernel form in one model: a fused qkv of two kinds (Q4_1 q and k, Q8_0 v),
    a Q5_1 o projection, MLPs that change kinds from layer to layer."""
    kind = MIXED_KINDS[name.split(".")[2]]
    return quantized(weights, kind if isinstance(kind, str) else kind[layer % 2])
