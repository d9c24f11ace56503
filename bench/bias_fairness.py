"""What one heavy request costs the others: four streams' token rate alone, then
beside an n=8 request, once with a full-vocabulary `logit_bias` and once without,
alternating, against a running server.

    python -m bench.bias_fairness --base-url http://127.0.0.1:8000 --rounds 2

The plain n=8 request is the baseline: on a small host eight more rows in every step
slow the four streams by themselves; the bias should cost little on top of that.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from .report import write_json
from .serve import server_parser


async def stream_rate(http: httpx.AsyncClient, url: str, model: str, tokens: int) -> float:
    body = {"model": model, "stream": True, "max_tokens": tokens, "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}]}
    first, count = None, 0
    async with http.stream("POST", url, json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and '"content":"' in line:
                count += 1
                first = first or time.perf_counter()
    return count / (time.perf_counter() - first) if first else 0.0


async def heavy(http: httpx.AsyncClient, url: str, model: str, vocab: int, biased: bool) -> int:
    body = {"model": model, "max_tokens": 200, "n": 8, "ignore_eos": True,
            "messages": [{"role": "user", "content": "hi"}]}
    if biased:
        body["logit_bias"] = {str(token): 0.0 for token in range(vocab)}
    return (await http.post(url, json=body)).status_code


async def measure(args) -> dict:
    url = f"{args.base_url.rstrip('/')}/v1/chat/completions"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(timeout=600, headers=headers) as http:
        async def four() -> float:
            rates = await asyncio.gather(*(stream_rate(http, url, args.model, args.tokens)
                                           for _ in range(4)))
            return round(sum(rates), 1)

        alone = await four()
        rounds = []
        for _ in range(args.rounds):
            for biased in (False, True):
                task = asyncio.create_task(heavy(http, url, args.model, args.vocab, biased))
                await asyncio.sleep(1.5)          # the heavy request is running
                beside = await four()
                status = await task
                rounds.append({"full_vocabulary_bias": biased, "heavy_status": status,
                               "four_streams_tok_s": beside, "ratio": round(beside / alone, 2)})
                print(rounds[-1], flush=True)
    return {"four_streams_alone_tok_s": alone, "rounds": rounds}


def main(argv=None) -> dict:
    parser = server_parser("python -m bench.bias_fairness", __doc__)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--tokens", type=int, default=96, help="tokens per measured stream")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    report = asyncio.run(measure(args))
    print(json.dumps({"four_streams_alone_tok_s": report["four_streams_alone_tok_s"]}))
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
