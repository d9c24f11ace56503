"""Online load test against any OpenAI-compatible server (ours, vLLM, llama.cpp's
llama-server, `transformers serve`), in the spirit of `vllm bench serve`.

    python -m bench.serve --base-url http://127.0.0.1:8000 --concurrency 1,8,32,64 \\
        --input-len 64 --output-len 128 --json bench-serve.json --plot bench-serve.png

For each concurrency level it keeps that many streaming chat completions (or, with
`--endpoint completions`, text completions) in flight
until `--num-requests` have finished, then reports output tokens/s, requests/s, and
p50/p90/p99 of time to first token (TTFT), inter-token latency (ITL) and end-to-end
latency, plus errors. Requests ask for exactly `--output-len` tokens (`ignore_eos`, a
vLLM extension this server honours; servers that ignore it may stop earlier, and
their output tokens are counted as received). `--response-format json_object` (or a
JSON schema file) constrains every request; such answers end when their JSON value
closes, so compare token rates (ITL) rather than request counts.

`--workload grounded` asks the model to repeat a given piece of code or add a
docstring to it (an answer made of its input, as code edits and quotes are) instead
of continuing a word list;
`--workload toolloop` runs an agent's tool loop (a call, then the answer to its
result; bench/tool_loop.py), the same loop each time, a loop per "request".
`--speculative off,on` runs every level twice against a server started with
`--speculative-config`, without drafts (`"speculative": false` in each body) and with
them, side by side in one run, after an unmeasured pass over the level's distinct
prompts (so both find the same prompts in the prefix cache):

    python -m server --speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'
    python -m bench.serve --base-url http://127.0.0.1:8000 --workload grounded \
        --speculative off,on --concurrency 1,4,8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from dataclasses import dataclass, field

import httpx

from .report import write_json
from .tool_loop import one_loop

WORDS = ("river stone garden window market teacher music bright quiet winter summer "
         "engine harbor letter signal forest planet silver morning story").split()


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    error: str = ""
    prompt_tokens: int = 0
    """From the final usage chunk (0 where the server sends none)."""


SNIPPETS = (
    "def merge_sorted(a, b):\n    result = []\n    i = j = 0\n"
    "    while i < len(a) and j < len(b):\n        if a[i] <= b[j]:\n"
    "            result.append(a[i])\n            i += 1\n        else:\n"
    "            result.append(b[j])\n            j += 1\n    return result\n",
    "def word_counts(text):\n    counts = {}\n    for word in text.split():\n"
    "        word = word.lower().strip('.,!?')\n        counts[word] = counts.get(word, 0) + 1\n"
    "    return sorted(counts.items(), key=lambda item: -item[1])\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, item):\n        self.items.append(item)\n\n"
    "    def pop(self):\n        if not self.items:\n"
    "            raise IndexError('pop from an empty stack')\n        return self.items.pop()\n",
    "def fibonacci(n):\n    a, b = 0, 1\n    numbers = []\n    for _ in range(n):\n"
    "        numbers.append(a)\n        a, b = b, a + b\n    return numbers\n",
)
"""Code the grounded workload hands the model (written for this benchmark)."""
GROUNDED_TASKS = ("Repeat this code exactly:",
                  "Add a docstring to this function and return the whole code:")
"""What it asks of the code, pasted in a fenced block as users paste it: to quote it,
or to edit it (an answer that is mostly its input)."""


def make_prompt(rng: random.Random, input_len: int, workload: str = "words") -> str:
    if workload == "grounded":
        return rng.choice(GROUNDED_TASKS) + "\n\n```python\n" + rng.choice(SNIPPETS) + "```"
    # about one token per word for these common words, plus the chat template
    return "Continue this list: " + " ".join(rng.choice(WORDS) for _ in range(input_len))


async def one_request(http: httpx.AsyncClient, url: str, body: dict) -> RequestResult:
    started = time.perf_counter()
    arrivals: list[float] = []
    usage_tokens = None
    prompt_tokens = 0
    try:
        async with http.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                return RequestResult(False, error=f"HTTP {response.status_code}")
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    prompt_tokens = chunk["usage"].get("prompt_tokens") or 0
                choices = chunk.get("choices") or []
                if choices and ((choices[0].get("delta") or {}).get("content")
                                or choices[0].get("text")):
                    arrivals.append(time.perf_counter())
    except (httpx.HTTPError, json.JSONDecodeError) as error:
        return RequestResult(False, error=type(error).__name__)
    if not arrivals:
        return RequestResult(False, error="no tokens")
    return RequestResult(True, ttft=arrivals[0] - started,
                         itls=[b - a for a, b in zip(arrivals, arrivals[1:])],
                         latency=time.perf_counter() - started,
                         output_tokens=usage_tokens or len(arrivals),
                         prompt_tokens=prompt_tokens)


async def run_level(args, concurrency: int, prompts: list[str],
                    speculative: bool | None = None) -> dict:
    """One level; `speculative` False sends `"speculative": false` in every body."""
    chat = args.endpoint == "chat"
    url = f"{args.base_url.rstrip('/')}/v1/{'chat/completions' if chat else 'completions'}"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    semaphore = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)

    async with httpx.AsyncClient(timeout=args.timeout, headers=headers, limits=limits) as http:
        async def limited(prompt: str) -> RequestResult:
            body = {"model": args.model, "stream": True, "max_tokens": args.output_len,
                    "temperature": 0, "ignore_eos": True,
                    "stream_options": {"include_usage": True}}
            if args.response_format is not None:
                body["response_format"] = args.response_format
            if speculative is False:
                body["speculative"] = False
            if args.workload == "toolloop":
                body = {key: body[key] for key in ("model", "max_tokens", "temperature")
                        if key in body} | ({"speculative": False} if speculative is False else {})
                async with semaphore:
                    return await one_loop(http, url, body, RequestResult)
            if chat:
                body["messages"] = [{"role": "user", "content": prompt}]
            else:
                body["prompt"] = prompt
            async with semaphore:
                return await one_request(http, url, body)

        started = time.perf_counter()
        results = await asyncio.gather(*(limited(p) for p in prompts))
        wall = time.perf_counter() - started
    return summarize(concurrency, results, wall)


def percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p90": None, "p99": None}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def summarize(concurrency: int, results: list[RequestResult], wall: float) -> dict:
    good = [r for r in results if r.ok]
    tokens = sum(r.output_tokens for r in good)
    return {
        "concurrency": concurrency, "requests": len(results), "errors": len(results) - len(good),
        "error_kinds": sorted({r.error for r in results if not r.ok}),
        "wall_s": round(wall, 3), "output_tokens": tokens,
        "output_tokens_per_s": round(tokens / wall, 1),
        "requests_per_s": round(len(good) / wall, 3),
        "ttft_ms": percentiles([r.ttft for r in good]),
        "itl_ms": percentiles([x for r in good for x in r.itls]),
        "e2e_ms": percentiles([r.latency for r in good]),
        "mean_output_tokens": round(statistics.mean(r.output_tokens for r in good), 1) if good else 0,
        "mean_prompt_tokens": round(statistics.mean(r.prompt_tokens for r in good), 1) if good else 0,
        # prompt tokens over time to first token, summed over requests: the prefill
        # rate at c=1 (at higher levels TTFT includes the wait for a slot)
        "prefill_tokens_per_s": round(sum(r.prompt_tokens for r in good)
                                      / sum(r.ttft for r in good), 1) if good else 0,
    }


def server_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser with the options of every tool that drives a server: its URL, the
    model name to send and an API key."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--api-key", default=None)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    parser = server_parser("python -m bench.serve", __doc__)
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    parser.add_argument("--num-requests", type=int, default=None,
                        help="requests per level (default: 2 x concurrency, at least 8)")
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    parser.add_argument("--endpoint", choices=("chat", "completions"), default="chat",
                        help="chat: the prompt inside the model's chat template; "
                             "completions: the raw prompt (TTFT without the template's tokens)")
    parser.add_argument("--label", default="server", help="name of the system in the report")
    parser.add_argument("--workload", choices=("words", "grounded", "toolloop"),
                        default="words",
                        help="continue a word list, repeat a given piece of code, or run "
                             "a tool loop (chat only)")
    parser.add_argument("--speculative", default=None, type=speculative_modes,
                        help="off,on: each level without and with speculative drafts")
    parser.add_argument("--response-format", default=None, type=response_format,
                        help="json_object, or a JSON schema file: constrain every request")
    parser.add_argument("--json", default=None)
    parser.add_argument("--plot", default=None)
    return parser.parse_args(argv)


def speculative_modes(value: str) -> list[bool]:
    modes = [mode.strip() for mode in value.split(",")]
    if not modes or any(mode not in ("on", "off") for mode in modes):
        raise argparse.ArgumentTypeError(f"expected on and/or off, comma-separated, got {value!r}")
    return [mode == "on" for mode in modes]


def response_format(value: str) -> dict:
    if value == "json_object":
        return {"type": "json_object"}
    with open(value) as schema_file:
        return {"type": "json_schema", "json_schema": {"name": "bench", "schema": json.load(schema_file)}}


def main(argv=None) -> dict:
    args = parse_args(argv)
    rng = random.Random(args.seed)
    levels = []
    modes = args.speculative or [None]
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        count = args.num_requests or max(8, 2 * concurrency)
        prompts = [make_prompt(rng, args.input_len, args.workload) for _ in range(count)]
        if len(modes) > 1:      # the first mode must not pay for a cold prefix cache alone
            asyncio.run(run_level(args, concurrency, sorted(set(prompts)), False))
        for mode in modes:
            level = asyncio.run(run_level(args, concurrency, prompts, mode))
            if mode is not None:
                level["speculative"] = "on" if mode else "off"
            levels.append(level)
            print(f"c={concurrency:<4} {level.get('speculative', ''):<3} "
                  f"{level['output_tokens_per_s']:>8} tok/s  "
                  f"{level['requests_per_s']:>7} req/s  TTFT p50 {level['ttft_ms']['p50']} ms  "
                  f"ITL p50 {level['itl_ms']['p50']} ms  e2e p50 {level['e2e_ms']['p50']} ms  "
                  f"errors {level['errors']}")
    report = {"label": args.label, "base_url": args.base_url,
              "workload": {"endpoint": args.endpoint, "kind": args.workload,
                           "input_len": args.input_len,
                           "output_len": args.output_len, "model": args.model,
                           "response_format": args.response_format},
              "levels": levels}
    write_json(args.json, report)
    if args.plot:
        from .plots import line_chart
        line_chart({args.label: {lv["concurrency"]: lv["output_tokens_per_s"] for lv in levels}},
                   "concurrent streams", "output tokens/s",
                   f"{args.model}: {args.input_len} in / {args.output_len} out", args.plot)
    return report


if __name__ == "__main__":
    main()
