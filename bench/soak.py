"""Soak test: keep N streams busy against a running server for T minutes, with random
prompt and answer lengths and some clients that hang up mid-stream, sampling the
server's resident memory and the token rate as it goes.

    python -m bench.soak --base-url http://127.0.0.1:8000 --pid SERVER_PID \\
        --streams 64 --minutes 10 --json soak.json

Each worker loops: a chat stream of 8-400 prompt words and 16-512 tokens; one in
`--disconnect-every` hangs up after a few chunks. Every `--sample-s` seconds it
records the server's RSS (psutil, with its children), output tokens per second since
the last sample, and the server's /health counters (free blocks, running). At the
end: requests, errors, disconnects, RSS first/max/last, and whether every KV block is
free again once the load stops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter

import httpx
import psutil

from .report import write_json
from .serve import WORDS, server_parser


def server_rss(pid: int) -> int:
    process = psutil.Process(pid)
    return process.memory_info().rss + sum(c.memory_info().rss for c in process.children(True))


async def worker(http: httpx.AsyncClient, args, seed: int, stop_at: float, stats: dict) -> None:
    rng = random.Random(seed)
    url = f"{args.base_url.rstrip('/')}/v1/chat/completions"
    while time.monotonic() < stop_at:
        prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 400)))
        body = {"model": args.model, "stream": True, "max_tokens": rng.randint(16, 512),
                "temperature": 0.8, "messages": [{"role": "user", "content": prompt}]}
        hang_up = rng.randrange(args.disconnect_every) == 0
        try:
            async with http.stream("POST", url, json=body) as response:
                if response.status_code != 200:
                    stats["errors"] += 1
                    stats["error_kinds"][f"HTTP {response.status_code}"] += 1
                    continue
                chunks = 0
                async for line in response.aiter_lines():
                    if line.startswith("data: {"):
                        chunks += 1
                        stats["tokens"] += 1
                        if line.startswith('data: {"error"'):
                            stats["errors"] += 1
                            stats["error_kinds"]["in-band"] += 1
                    if hang_up and chunks >= 4:
                        stats["disconnects"] += 1
                        break
            stats["requests"] += 1
        except httpx.HTTPError as error:
            stats["errors"] += 1
            stats["error_kinds"][type(error).__name__] += 1


async def sampler(http: httpx.AsyncClient, args, stop_at: float, stats: dict) -> list[dict]:
    samples, last_tokens, last_time = [], 0, time.monotonic()
    while time.monotonic() < stop_at:
        await asyncio.sleep(args.sample_s)
        now = time.monotonic()
        health = (await http.get(f"{args.base_url.rstrip('/')}/health")).json()
        samples.append({"t_s": round(now - (stop_at - args.minutes * 60), 1),
                        "rss_mb": round(server_rss(args.pid) / 2**20, 1),
                        "tok_s": round((stats["tokens"] - last_tokens) / (now - last_time), 1),
                        "running": health.get("num_running"),
                        "free_blocks": health.get("num_free_blocks")})
        last_tokens, last_time = stats["tokens"], now
        print(samples[-1], flush=True)
    return samples


async def soak(args) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    stats = {"requests": 0, "errors": 0, "disconnects": 0, "tokens": 0,
             "error_kinds": Counter()}
    stop_at = time.monotonic() + args.minutes * 60
    limits = httpx.Limits(max_connections=args.streams + 4)
    async with httpx.AsyncClient(timeout=600, headers=headers, limits=limits) as http:
        rss_start = server_rss(args.pid)
        watch = asyncio.create_task(sampler(http, args, stop_at, stats))
        await asyncio.gather(*(worker(http, args, seed, stop_at, stats)
                               for seed in range(args.streams)))
        samples = await watch
        await asyncio.sleep(2)
        health = (await http.get(f"{args.base_url.rstrip('/')}/health")).json()
    rss = [s["rss_mb"] for s in samples]
    return {**stats, "streams": args.streams, "minutes": args.minutes,
            "rss_mb": {"start": round(rss_start / 2**20, 1), "max": max(rss, default=None),
                       "last": rss[-1] if rss else None},
            "blocks_free_after": health.get("num_free_blocks") == health.get("num_blocks"),
            "samples": samples}


def main(argv=None) -> dict:
    parser = server_parser("python -m bench.soak", __doc__)
    parser.add_argument("--pid", type=int, required=True, help="the server's process id")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--minutes", type=float, default=10.0)
    parser.add_argument("--disconnect-every", type=int, default=10)
    parser.add_argument("--sample-s", type=float, default=10.0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    report = asyncio.run(soak(args))
    summary = {k: v for k, v in report.items() if k != "samples"}
    print(json.dumps(summary))
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main()
