"""Offline throughput: the engine's `generate_batch` against transformers on the same
weights, side by side in one run, with the machine's limits measured alongside.

    python -m bench.offline --num-prompts 64 --input-len 64 --output-len 128 \\
        --peers transformers-cb,transformers-static --json bench-offline.json --plot bench-offline.png

Every request generates exactly `--output-len` tokens (EOS ignored) from a random
prompt of `--input-len` tokens (fixed seed), so every system does the same work.
Throughput is generated tokens / wall time of the whole batch, warm-up excluded.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import time

import torch

from engine import ContinuousBatchingConfig, GenerationConfig, load_model
from engine.loading.model_files import pretrained_arguments

from .machine import measure
from .report import write_json

PEERS = ("transformers-cb", "transformers-static")


def make_prompts(num_prompts: int, input_len: int, vocab_size: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab_size) for _ in range(input_len)] for _ in range(num_prompts)]


ENGINE_STATS = ("decode_fast_path", "num_decode_graphs", "num_graph_steps",
                "num_compiled_steps", "async_batching", "num_lookahead_steps", "num_steps")
"""What the timed run's engine did: the paths that served it (graphs, compiled steps).
The report adds the warm-up's seconds and, when compiling, the graphs torch built."""


def run_kvserve(model, prompts, output_len: int, cb_config: dict
                ) -> tuple[float, int, dict[str, int]]:
    generation = GenerationConfig(max_new_tokens=output_len, eos_token_id=[])
    config = ContinuousBatchingConfig(**cb_config)
    compiling = any(cb_config.get(k) for k in ("default_compile_level", "varlen_compile_config"))
    # compiled layer steps build their graphs on first use (prefill waves, decodes): a
    # warm-up of the whole batch builds them outside the timing
    warm = prompts if compiling else prompts[:2]
    graphs_before = _compiled_graphs() if compiling else 0
    started = time.perf_counter()
    model.generate_batch(warm, GenerationConfig(max_new_tokens=4, eos_token_id=[]), config)
    warmup_seconds = time.perf_counter() - started
    graphs_warm = _compiled_graphs() if compiling else 0
    started = time.perf_counter()
    # the process is warm: no dummy prefill inside the timing (CUDA graphs, where there
    # are any, are recorded on the first step of each batch size, inside it)
    outputs = model.generate_batch(prompts, generation, config, warmup=False,
                                   persistent_manager=True)
    seconds = time.perf_counter() - started
    manager = model.kept_manager
    stats = {k: v for k, v in manager.stats().items() if k in ENGINE_STATS}
    manager.destroy()
    stats["warmup_seconds"] = round(warmup_seconds, 2)
    if compiling:       # graphs torch built in the warm-up, and later (new kinds of step)
        stats["compiled_graphs"] = graphs_warm - graphs_before
        stats["compiled_graphs_after_warmup"] = _compiled_graphs() - graphs_warm
    return seconds, sum(len(o.generated_tokens) for o in outputs.values()), stats


def _compiled_graphs() -> int:
    """Graphs torch.compile has built in this process (every frame and recompile)."""
    from torch._dynamo.utils import counters
    return counters["stats"]["unique_graphs"]


def load_reference(spec: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    path, where = pretrained_arguments(spec)
    return AutoModelForCausalLM.from_pretrained(
        path, **where, dtype=dtype, attn_implementation="sdpa").to(device).eval()


def run_transformers_cb(reference, prompts, output_len: int) -> tuple[float, int]:
    from transformers import GenerationConfig as HFGenerationConfig

    generation = HFGenerationConfig(max_new_tokens=output_len, eos_token_id=-1, do_sample=False)
    reference.generate_batch(prompts[:2], HFGenerationConfig(max_new_tokens=4, eos_token_id=-1,
                                                             do_sample=False))
    started = time.perf_counter()
    outputs = reference.generate_batch(prompts, generation)
    seconds = time.perf_counter() - started
    return seconds, sum(len(o.generated_tokens) for o in outputs.values())


@torch.inference_mode()
def run_transformers_static(reference, prompts, output_len: int, batch_size: int) -> tuple[float, int]:
    def generate(batch):
        ids = torch.tensor(batch, device=reference.device)   # equal lengths: no padding
        out = reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=output_len, min_new_tokens=output_len,
                                 pad_token_id=0)
        return (out.shape[1] - ids.shape[1]) * ids.shape[0]

    generate(prompts[:2])
    started = time.perf_counter()
    tokens = sum(generate(prompts[i:i + batch_size]) for i in range(0, len(prompts), batch_size))
    return time.perf_counter() - started, tokens


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.offline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        help="auto, float32 or bfloat16 (load_model's kv_cache_dtype)")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--cuda-graph", choices=("auto", "on", "off"), default="auto",
                        help="use_cuda_graph: auto (None), on (True) or off (False)")
    parser.add_argument("--async-batching", choices=("auto", "on", "off"), default="auto",
                        help="use_async_batching: auto (None: on where graphs serve a CUDA "
                             "model), on (True) or off (False)")
    parser.add_argument("--page-size", type=int, default=None)
    parser.add_argument("--max-batch-tokens", type=int, default=None)
    parser.add_argument("--max-requests-per-batch", type=int, default=None,
                        help="at most this many requests per step: the prompts then run "
                             "in waves, as a server's clients at that concurrency send them")
    parser.add_argument("--compile-level", type=int, default=0,
                        help="default_compile_level (0-3; it gives no settings on CPU)")
    parser.add_argument("--compile", default=None, metavar="JSON",
                        help='compile settings for both paths, e.g. \'{"dynamic": true}\' '
                             "(varlen_compile_config and decode_compile_config; honoured "
                             "on CPU too)")
    parser.add_argument("--peers", default="",
                        help=f"comma-separated peers to run on the same weights: {', '.join(PEERS)}")
    parser.add_argument("--static-batch", type=int, default=16,
                        help="batch size of transformers' static generate")
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--plot", default=None, help="write a PNG bar chart here")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    peers = [p for p in args.peers.split(",") if p]
    unknown = set(peers) - set(PEERS)
    if unknown:
        raise SystemExit(f"unknown peers {sorted(unknown)}; choose from {PEERS}")
    model = load_model(args.model, dtype=args.dtype, device=args.device, progress=False,
                       kv_cache_dtype=args.kv_cache_dtype)
    prompts = make_prompts(args.num_prompts, args.input_len, model.config.vocab_size, args.seed)
    cb_config = {k: v for k, v in (("page_size", args.page_size),
                                   ("max_batch_tokens", args.max_batch_tokens),
                                   ("max_requests_per_batch", args.max_requests_per_batch)) if v}
    if args.cuda_graph != "auto":
        cb_config["use_cuda_graph"] = args.cuda_graph == "on"
    if args.async_batching != "auto":
        cb_config["use_async_batching"] = args.async_batching == "on"
    if args.compile_level:
        cb_config["default_compile_level"] = args.compile_level
    if args.compile:
        settings = json.loads(args.compile)
        cb_config.update(varlen_compile_config=settings, decode_compile_config=settings)
    limits = (measure(model.config.hidden_size, model.config.intermediate_size)
              if model.device.type == "cpu" else
              {"accelerator": torch.cuda.get_device_name(model.device)})   # the CPU's are moot
    seconds, tokens, engine_stats = run_kvserve(model, prompts, args.output_len, cb_config)
    runs = {"kvserve": (seconds, tokens)}
    if peers:
        reference = load_reference(args.model, model.dtype, model.device)
        if "transformers-cb" in peers:
            runs["transformers-cb"] = run_transformers_cb(reference, prompts, args.output_len)
        if "transformers-static" in peers:
            runs["transformers-static"] = run_transformers_static(
                reference, prompts, args.output_len, args.static_batch)
    report = build_report(args, runs, limits)
    report["engine"] = engine_stats
    print_report(report)
    write_json(args.json, report)
    if args.plot:
        from .plots import bar_chart
        bar_chart({name: r["output_tokens_per_s"] for name, r in report["results"].items()},
                  "output tokens/s", f"{args.model}, {args.num_prompts} prompts x "
                  f"{args.output_len} tokens ({args.dtype})", args.plot)
    return report


def build_report(args, runs: dict, limits: dict) -> dict:
    ours = runs["kvserve"][1] / runs["kvserve"][0]
    results = {}
    for name, (seconds, tokens) in runs.items():
        rate = tokens / seconds
        results[name] = {"seconds": round(seconds, 3), "output_tokens": tokens,
                         "output_tokens_per_s": round(rate, 1),
                         "kvserve_speedup": round(ours / rate, 2)}
    return {"workload": {k: getattr(args, k) for k in (
                "model", "dtype", "kv_cache_dtype", "device", "cuda_graph", "async_batching",
                "num_prompts",
                "input_len", "output_len", "max_requests_per_batch", "compile_level",
                "compile", "seed")},
            "machine": {"platform": platform.platform(), "torch": torch.__version__, **limits},
            "results": results}


def print_report(report: dict) -> None:
    print(json.dumps(report["workload"]))
    print(json.dumps(report["machine"]))
    print(f"{'system':<22}{'seconds':>10}{'tokens':>10}{'tok/s':>10}{'kvserve x':>11}")
    for name, r in report["results"].items():
        print(f"{name:<22}{r['seconds']:>10}{r['output_tokens']:>10}"
              f"{r['output_tokens_per_s']:>10}{r['kvserve_speedup']:>11}")
    if "engine" in report:
        print("kvserve engine:", json.dumps(report["engine"]))


if __name__ == "__main__":
    main()
