"""Accuracy of a fast dtype against the exact fp32 path: greedy agreement over a fixed
set of chat prompts.

    python -m bench.accuracy --dtype bfloat16 --num-prompts 16 --output-len 32

    python -m bench.accuracy --model gemma3-270m --dtype float32,int8-activations \
        --llama-server --num-prompts 64

The exact path is fp32 on the weights dequantized (no block kernels). Reports, for
each column (each dtype, and llama.cpp's server with `--llama-server`), how many
leading generated tokens per prompt equal the exact path's, the share of prompts
generated identically and the mean agreeing prefix.
"""

from __future__ import annotations

import argparse
import json

from engine import ContinuousBatchingConfig, GenerationConfig, load_model
from engine.loading.model_files import gguf_source

from .llama_cpp import llama_server
from .llama_greedy import LlamaGreedy
from .report import write_json

TOPICS = ("the ocean", "a city at night", "learning to cook", "the history of maps",
          "why leaves change colour", "a robot that paints", "winter in the mountains",
          "how bridges stand", "a letter to a friend", "the moon landing",
          "coffee", "a rainy market", "trains", "music and memory", "gardening", "chess")


REQUESTS = ("Write a short paragraph about {}.", "Explain {} to a child.",
            "List three facts about {}.", "Write a haiku about {}.")


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` chat prompts, all different up to 64 (16 topics x 4 requests); a base
    model without a chat template gets the requests as plain text."""
    prompts = []
    for index in range(count):
        topic = TOPICS[index % len(TOPICS)]
        request = REQUESTS[index // len(TOPICS) % len(REQUESTS)]
        if tokenizer.chat_template is None:
            prompts.append(list(tokenizer(request.format(topic))["input_ids"]))
            continue
        messages = [{"role": "user", "content": request.format(topic)}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    return prompts


def agreeing_prefix(a: list[int], b: list[int]) -> int:
    count = 0
    for x, y in zip(a, b):
        if x != y:
            break
        count += 1
    return count


def agreement(exact: list[list[int]], generated: list[list[int]], output_len: int) -> dict:
    """How `generated` agrees with the exact path's generations, prompt by prompt."""
    prefixes = [agreeing_prefix(a, b) for a, b in zip(exact, generated)]
    return {"identical_share": round(sum(p == output_len for p in prefixes) / len(prefixes), 3),
            "mean_agreeing_prefix": round(sum(prefixes) / len(prefixes), 1),
            "agreeing_prefix_per_prompt": prefixes}


def engine_generations(args, dtype: str, prompts: list[list[int]], generation) -> list[list[int]]:
    model = load_model(args.model, dtype=dtype, progress=False,
                       kv_cache_dtype=args.kv_cache_dtype)
    cb_config = ContinuousBatchingConfig(max_requests_per_batch=args.max_requests_per_batch)
    outputs = model.generate_batch(prompts, generation, cb_config)
    return [o.generated_tokens for o in outputs.values()]


def llama_server_generations(args, prompts: list[list[int]]) -> list[list[int]]:
    path = gguf_source(args.model)
    if path is None:
        raise SystemExit(f"--llama-server needs a GGUF model; {args.model!r} is not one")
    binary = llama_server(isa=args.llama_isa)
    with LlamaGreedy(binary, path, args.llama_port) as peer:
        return [peer.generate(prompt, args.output_len) for prompt in prompts]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.accuracy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16",
                        help="comma-separated dtypes, each a column (auto: the default)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto, float32 or bfloat16 (load_model's kv_cache_dtype)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-requests-per-batch", type=int, default=None,
                        help="cap the fast run's batch (e.g. 8: every decode step then "
                             "runs on the block kernels of a GGUF model)")
    parser.add_argument("--llama-server", action="store_true",
                        help="add llama.cpp's server as a column (GGUF models; built by "
                             "bench.llama_cpp on first use)")
    parser.add_argument("--llama-isa", choices=("native", "avx2"), default="native")
    parser.add_argument("--llama-port", type=int, default=8131)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    generation = GenerationConfig(max_new_tokens=args.output_len, eos_token_id=[])
    reference = load_model(args.model, dtype="float32", progress=False, block_kernels=False)
    prompts = chat_prompts(reference.tokenizer, args.num_prompts)
    exact = [o.generated_tokens for o in reference.generate_batch(prompts, generation).values()]
    del reference
    columns = {dtype: agreement(exact, engine_generations(args, dtype, prompts, generation),
                                args.output_len)
               for dtype in args.dtype.split(",")}
    if args.llama_server:
        columns["llama-server"] = agreement(exact, llama_server_generations(args, prompts),
                                            args.output_len)
    report = {"model": args.model, "kv_cache_dtype": args.kv_cache_dtype,
              "num_prompts": args.num_prompts, "output_len": args.output_len,
              "max_requests_per_batch": args.max_requests_per_batch, "columns": columns}
    print(json.dumps(report))
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
