"""Accuracy of a fast dtype against the exact fp32 path: greedy agreement over a fixed
set of chat prompts.

    python -m bench.accuracy --dtype bfloat16 --num-prompts 16 --output-len 32

Reports, per prompt, how many leading generated tokens equal fp32's, and overall the
share of prompts generated identically and the mean agreeing prefix.
"""

from __future__ import annotations

import argparse
import json

from engine import ContinuousBatchingConfig, GenerationConfig, load_model

from .report import write_json

TOPICS = ("the ocean", "a city at night", "learning to cook", "the history of maps",
          "why leaves change colour", "a robot that paints", "winter in the mountains",
          "how bridges stand", "a letter to a friend", "the moon landing",
          "coffee", "a rainy market", "trains", "music and memory", "gardening", "chess")


REQUESTS = ("Write a short paragraph about {}.", "Explain {} to a child.",
            "List three facts about {}.", "Write a haiku about {}.")


def chat_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` chat prompts, all different up to 64 (16 topics x 4 requests)."""
    prompts = []
    for index in range(count):
        topic = TOPICS[index % len(TOPICS)]
        request = REQUESTS[index // len(TOPICS) % len(REQUESTS)]
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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.accuracy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto, float32 or bfloat16 (load_model's kv_cache_dtype)")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--max-requests-per-batch", type=int, default=None,
                        help="cap the fast run's batch (e.g. 8: every decode step then "
                             "runs on the block kernels of a GGUF model)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    generation = GenerationConfig(max_new_tokens=args.output_len, eos_token_id=[])
    reference = load_model(args.model, dtype="float32", progress=False, block_kernels=False)
    prompts = chat_prompts(reference.tokenizer, args.num_prompts)
    exact = [o.generated_tokens for o in reference.generate_batch(prompts, generation).values()]
    fast_model = load_model(args.model, dtype=args.dtype, progress=False,
                            kv_cache_dtype=args.kv_cache_dtype)
    cb_config = ContinuousBatchingConfig(max_requests_per_batch=args.max_requests_per_batch)
    fast = [o.generated_tokens
            for o in fast_model.generate_batch(prompts, generation, cb_config).values()]
    prefixes = [agreeing_prefix(a, b) for a, b in zip(exact, fast)]
    report = {"model": args.model, "dtype": args.dtype, "kv_cache_dtype": args.kv_cache_dtype,
              "output_len": args.output_len,
              "max_requests_per_batch": args.max_requests_per_batch,
              "identical_share": round(sum(p == args.output_len for p in prefixes) / len(prefixes), 3),
              "mean_agreeing_prefix": round(sum(prefixes) / len(prefixes), 1),
              "agreeing_prefix_per_prompt": prefixes}
    print(json.dumps(report))
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
