"""A random-weight GGUF file of a real model's shapes, for memory, start-up and speed
measurements of models no package ships (nothing is downloaded: the weights are
drawn here, the tokenizer is the default model's, whose vocabulary SmolLM2's larger
models share).

    python -m bench.random_gguf /tmp/smollm2-1.7b-q4_0.gguf              # ~1 GB, ~2 min
    python -m bench.random_gguf /tmp/small.gguf --layers 4 --hidden 256 \\
        --intermediate 512 --heads 4 --kv-heads 2
    python -m bench.random_gguf /tmp/smollm2-1.7b-q4_k_m.gguf --quantize Q4_K_M

The default shapes are SmolLM2-1.7B's (a Llama: 24 layers, hidden 2048, 32 query and
32 KV heads of 64, MLP 8192, vocabulary 49152, tied embeddings). Projections are
written as `--kind` (gguf-py quantizes Q4_0, Q4_1, Q5_0, Q5_1 and Q8_0; Q4_0 is the
common 4.5-bit type, what a Q4_K_M file holds in spirit), the embedding table as
`--embedding-kind` (Q8_0), norms as F32. Weights are normal with standard deviation
0.02 (a trained model's scale), norms 1: the text is noise, the costs are real.
`--quantize TYPE` writes Q8_0 first and has llama.cpp's `llama-quantize` (built by
bench.llama_cpp on first use, ~15 minutes) turn it into TYPE (Q4_K_M, Q5_K_M, ...:
the K-quant mixtures gguf-py cannot write), as a user's file is made.
"""

from __future__ import annotations

import argparse
import subprocess
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LlamaShape:
    layers: int = 24
    hidden: int = 2048
    intermediate: int = 8192
    heads: int = 32
    kv_heads: int = 32
    vocab: int = 49152

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads


def _tokenizer_fields(writer) -> int:
    """Copy the default model's tokenizer fields into `writer`; returns its vocabulary."""
    import gguf

    from engine.loading.model_files import resolve_embedded

    reader = gguf.GGUFReader(str(resolve_embedded("smollm2-135m-instruct")))
    for field in reader.fields.values():
        if field.name.startswith("tokenizer."):
            value_type = field.types[0]
            sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
            writer.add_key_value(field.name, field.contents(), value_type, sub_type=sub_type)
    return len(reader.fields["tokenizer.ggml.tokens"].contents())


def write_random_gguf(path: str, shape: LlamaShape = LlamaShape(), kind: str = "Q4_0",
                      embedding_kind: str = "Q8_0", seed: int = 0) -> str:
    import gguf
    from gguf import GGMLQuantizationType as Type, quants

    writer = gguf.GGUFWriter(path, "llama")
    vocab = _tokenizer_fields(writer)
    if vocab != shape.vocab:
        raise ValueError(f"the tokenizer has {vocab} tokens, the shape asks for {shape.vocab}")
    writer.add_name("random-llama")
    writer.add_context_length(8192)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(130000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    generator = np.random.default_rng(seed)

    def weights(rows: int, cols: int, type_name: str):
        values = generator.standard_normal((rows, cols), dtype=np.float32) * 0.02
        return quants.quantize(values, Type[type_name]), Type[type_name]

    norm = np.ones(shape.hidden, dtype=np.float32)
    tensors = [("token_embd.weight", *weights(vocab, shape.hidden, embedding_kind)),
               ("output_norm.weight", norm, Type.F32)]
    q_rows, kv_rows = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    for layer in range(shape.layers):
        blk = f"blk.{layer}."
        tensors += [(blk + "attn_norm.weight", norm, Type.F32),
                    (blk + "ffn_norm.weight", norm, Type.F32)]
        for name, rows, cols in (("attn_q", q_rows, shape.hidden), ("attn_k", kv_rows, shape.hidden),
                                 ("attn_v", kv_rows, shape.hidden),
                                 ("attn_output", shape.hidden, q_rows),
                                 ("ffn_gate", shape.intermediate, shape.hidden),
                                 ("ffn_up", shape.intermediate, shape.hidden),
                                 ("ffn_down", shape.hidden, shape.intermediate)):
            tensors.append((blk + name + ".weight", *weights(rows, cols, kind)))
    write_tensors(writer, tensors)
    return path


def write_tensors(writer, tensors: list[tuple[str, np.ndarray, object]]) -> None:
    """(name, GGUF bytes or values, quantization type) in order into `writer` (a
    gguf.GGUFWriter holding the metadata), then the file closed."""
    for name, data, type_ in tensors:
        writer.add_tensor_info(name, data.shape, data.dtype, data.nbytes, type_)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, data, _ in tensors:
        writer.write_tensor_data(data)
    writer.close()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.random_gguf", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path")
    defaults = LlamaShape()
    for name in ("layers", "hidden", "intermediate", "heads", "kv_heads"):
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--kind", default="Q4_0")
    parser.add_argument("--embedding-kind", default="Q8_0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quantize", default=None, help="a llama-quantize type, e.g. Q4_K_M")
    parser.add_argument("--llama-isa", choices=("native", "avx2"), default="native",
                        help="which llama.cpp build's llama-quantize (bench.llama_cpp --isa)")
    args = parser.parse_args(argv)
    shape = LlamaShape(args.layers, args.hidden, args.intermediate, args.heads, args.kv_heads)
    started = time.perf_counter()
    if args.quantize is None:
        write_random_gguf(args.path, shape, args.kind, args.embedding_kind, args.seed)
    else:
        quantized(args.path, shape, args.quantize, args.seed, args.llama_isa)
    print(f"wrote {args.path} in {time.perf_counter() - started:.0f} s")


def quantized(path: str, shape: LlamaShape, kind: str, seed: int, isa: str = "native") -> None:
    """A random Q8_0 file turned into `kind` by llama.cpp's llama-quantize (of the
    bench.llama_cpp build for `isa`)."""
    from .llama_cpp import llama_server

    quantize = llama_server(tool="llama-quantize", isa=isa)
    with tempfile.TemporaryDirectory(dir=Path(path).resolve().parent) as staging:
        source = Path(staging) / "q8_0.gguf"
        write_random_gguf(str(source), shape, "Q8_0", "Q8_0", seed)
        subprocess.run([str(quantize), "--allow-requantize", str(source), path, kind],
                       check=True, capture_output=True, text=True)


if __name__ == "__main__":
    main()
