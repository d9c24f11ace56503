"""Embeddings beside running streams: what a batch of embedding inputs costs the chats
streaming meanwhile, against the same prompt tokens sent as one-token completions.

    python -m bench.embed_load --base-url http://127.0.0.1:8000 --streams 8 --inputs 2000

Two phases, one after the other, on one server: each starts `--streams` streaming
chats (`--output-len` tokens, EOS ignored) and, `--delay` seconds later, sends
`--inputs` texts of `--input-words` words in requests of `--batch`, one request at a
time: to /v1/embeddings in the first phase, to /v1/completions with `max_tokens: 1`
in the second (the same prompts, the same batches). Both are prefill work the engine
interleaves with the streams' decodes; an embedding should cost the streams no more
than a prompt of its length does. Reports per phase the streams' ITL p50/p99 and
longest gap, and how long the batch took.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time

import httpx

from .report import write_json
from .serve import RequestResult, make_prompt, one_request, percentiles, server_parser

PHASES = ("embeddings", "completions")


async def phase(args, kind: str, texts: list[str]) -> dict:
    base = args.base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)
    stream_body = {"model": args.model, "stream": True, "max_tokens": args.output_len,
                   "temperature": 0, "ignore_eos": True,
                   "stream_options": {"include_usage": True},
                   "messages": [{"role": "user", "content": make_prompt(rng, 40)}]}
    limits = httpx.Limits(max_connections=args.streams + 1)
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as http:
        streams = [asyncio.create_task(one_request(http, f"{base}/v1/chat/completions",
                                                   stream_body))
                   for _ in range(args.streams)]
        await asyncio.sleep(args.delay)
        started, errors = time.perf_counter(), 0
        for first in range(0, len(texts), args.batch):
            batch = texts[first:first + args.batch]
            if kind == "embeddings":
                reply = await http.post(f"{base}/v1/embeddings", json={
                    "model": args.model, "input": batch, "encoding_format": "base64"})
            else:
                reply = await http.post(f"{base}/v1/completions", json={
                    "model": args.model, "prompt": batch, "max_tokens": 1, "temperature": 0})
            errors += reply.status_code != 200
        took = time.perf_counter() - started
        results: list[RequestResult] = list(await asyncio.gather(*streams))
    gaps = [gap for result in results if result.ok for gap in result.itls]
    return {"kind": kind, "batch_s": round(took, 2), "batch_errors": errors,
            "stream_errors": sum(not r.ok for r in results), "itl_ms": percentiles(gaps),
            "longest_gap_ms": round(max(gaps) * 1000, 1) if gaps else None}


def parse_args(argv=None) -> argparse.Namespace:
    parser = server_parser("python -m bench.embed_load", __doc__)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--output-len", type=int, default=600)
    parser.add_argument("--inputs", type=int, default=2000)
    parser.add_argument("--input-words", type=int, default=8)
    parser.add_argument("--batch", type=int, default=64, help="inputs per request")
    parser.add_argument("--delay", type=float, default=1.5,
                        help="seconds between the streams' start and the batch's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    rng = random.Random(args.seed + 1)
    texts = [make_prompt(rng, args.input_words).removeprefix("Continue this list: ")
             for _ in range(args.inputs)]
    phases = [asyncio.run(phase(args, kind, texts)) for kind in PHASES]
    for result in phases:
        print(f"{result['kind']:<12} batch {result['batch_s']} s  streams ITL p50 "
              f"{result['itl_ms']['p50']} ms p99 {result['itl_ms']['p99']} ms, longest gap "
              f"{result['longest_gap_ms']} ms  errors {result['batch_errors']}/"
              f"{result['stream_errors']}")
    report = {"base_url": args.base_url, "workload": {
        "streams": args.streams, "output_len": args.output_len, "inputs": args.inputs,
        "input_words": args.input_words, "batch": args.batch, "model": args.model},
        "phases": phases}
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
