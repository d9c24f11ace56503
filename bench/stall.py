"""A long prompt beside running streams: how long they stall while it prefills.

    python -m bench.stall --base-url http://127.0.0.1:8000 --streams 8 --long-words 3000

Starts `--streams` streaming chats (`--input-len` words in, `--output-len` tokens out,
EOS ignored) and, `--delay` seconds later, one chat of `--long-words` words asking for
`--long-output-len` tokens. A server step holds every stream in it, so the long
prompt's prefill shows as a gap in each of them: reports the streams' longest gap
between two tokens, their ITL p50/p99, and the long request's TTFT. Run it against
two servers (or two `--max-batch-tokens` of one) one after the other and compare.
"""

from __future__ import annotations

import argparse
import asyncio
import random

import httpx

from .report import write_json
from .serve import RequestResult, make_prompt, one_request, percentiles, server_parser


async def run(args) -> tuple[list[RequestResult], RequestResult]:
    url = f"{args.base_url.rstrip('/')}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    rng = random.Random(args.seed)

    def body(words: int, max_tokens: int) -> dict:
        return {"model": args.model, "stream": True, "max_tokens": max_tokens,
                "temperature": 0, "ignore_eos": True,
                "stream_options": {"include_usage": True},
                "messages": [{"role": "user", "content": make_prompt(rng, words)}]}

    limits = httpx.Limits(max_connections=args.streams + 1)
    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as http:
        streams = [asyncio.create_task(one_request(http, url, body(args.input_len,
                                                                   args.output_len)))
                   for _ in range(args.streams)]
        await asyncio.sleep(args.delay)
        long_request = await one_request(http, url, body(args.long_words,
                                                         args.long_output_len))
        return list(await asyncio.gather(*streams)), long_request


def summarize(streams: list[RequestResult], long_request: RequestResult) -> dict:
    gaps = [gap for stream in streams if stream.ok for gap in stream.itls]
    return {
        "streams": len(streams),
        "errors": sum(not s.ok for s in streams) + (not long_request.ok),
        "stream_output_tokens": [s.output_tokens for s in streams],
        "longest_gap_ms": round(max(gaps) * 1000, 1) if gaps else None,
        "itl_ms": percentiles(gaps),
        "long_ttft_ms": round(long_request.ttft * 1000, 1) if long_request.ok else None,
        "long_output_tokens": long_request.output_tokens,
    }


def parse_args(argv=None) -> argparse.Namespace:
    parser = server_parser("python -m bench.stall", __doc__)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--input-len", type=int, default=40, help="words of each stream's chat")
    parser.add_argument("--output-len", type=int, default=400)
    parser.add_argument("--long-words", type=int, default=3000)
    parser.add_argument("--long-output-len", type=int, default=8)
    parser.add_argument("--delay", type=float, default=1.5,
                        help="seconds between the streams' start and the long chat's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--json", default=None)
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    streams, long_request = asyncio.run(run(args))
    report = {"base_url": args.base_url,
              "workload": {"streams": args.streams, "input_len": args.input_len,
                           "output_len": args.output_len, "long_words": args.long_words,
                           "long_output_len": args.long_output_len, "delay_s": args.delay,
                           "model": args.model},
              **summarize(streams, long_request)}
    print(f"{args.streams} streams: longest gap {report['longest_gap_ms']} ms, ITL p50 "
          f"{report['itl_ms']['p50']} ms p99 {report['itl_ms']['p99']} ms; long chat "
          f"({args.long_words} words) TTFT {report['long_ttft_ms']} ms; "
          f"errors {report['errors']}")
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
