"""The torch ops one decode step on the decode fast path launches: what a CUDA graph of
that step holds, counted on any machine.

On a GPU a small model's decode step is bound by how many kernels it runs, not by
their work (an H200 replays an empty graph node in ~1 us; a 135M model's one-token
step was ~3.9 ms of device time for 1,168 kernels, docs/benchmarks.md). This tool runs the decode fast path's step (the forward over the padded static
buffers that the graphs record, `DecodeGraphs` with capture off; the copies into those
buffers run outside the graph and are not counted) on the CPU with the
native kernels off, so the same torch ops run as on CUDA, and counts the ops that
reach a kernel (views and metadata-only ops left out), per layer and in all:

    python -m bench.decode_ops --model /tmp/model --dtype bfloat16 --requests 4

CPU and CUDA pick different kernels for a few ops (SDPA's), so the count is a
proxy, but the changes it shows are the ones a graph would see. A composite op counts
once, whatever it runs inside, with one exception: SDPA given a bool mask turns it
into an additive one on every call, counted as one `where (SDPA's bool mask)`.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from engine import load_model
from engine.step.decode_tables import DecodeTables
from engine.generation_config import SamplingParams
from engine.kv_cache.sizing import CacheSizing
from engine.core.requests import RequestState
from engine.step.runner import ModelRunner
from engine.core.scheduler import ScheduledBatch, ScheduledRequest

NO_KERNEL = {"view", "_unsafe_view", "reshape", "as_strided", "slice", "select", "unsqueeze",
             "squeeze", "expand", "transpose", "t", "permute", "alias", "detach", "split",
             "split_with_sizes", "chunk", "unbind", "narrow", "lift_fresh", "empty",
             "empty_strided", "_to_copy_noop", "result_type", "sym_size", "sym_stride",
             "sym_numel", "is_same_size", "_reshape_alias", "view_as_real", "view_as_complex",
             "promote_types"}
CONVERSIONS = {"to", "type_as", "contiguous", "float", "long", "int", "bfloat16"}
"""Ops that run a kernel only when they change their input (else they return it)."""
RESHAPES = {"reshape", "flatten"}
"""Views when they can be, else copies (counted then)."""


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        if name in CONVERSIONS and args and result is args[0]:
            return result
        if name in RESHAPES:
            if result.untyped_storage().data_ptr() != args[0].untyped_storage().data_ptr():
                self.counts[name] += 1
            return result
        if name not in NO_KERNEL:
            self.counts[name] += 1
        if name == "scaled_dot_product_attention":
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            if mask is not None and mask.dtype == torch.bool:
                self.counts["where (SDPA's bool mask)"] += 1
        return result


def decode_step_ops(model_spec: str, dtype: str, num_requests: int, context: int
                    ) -> tuple[collections.Counter, int]:
    """The ops of one decode step's forward, by name, and the model's layer count."""
    # the cache in the model's dtype, as accelerators keep it (a CPU's default is fp32)
    model = load_model(model_spec, dtype=dtype, progress=False,
                       kv_cache_dtype="auto" if dtype == "float32" else dtype)
    module = model.module
    page_size, num_blocks = 256, num_requests * (-(-(context + 1) // 256)) + 1
    sizing = CacheSizing(num_blocks, page_size, context + 1, num_requests, 0)
    width = -(-(context + 1) // page_size)
    runner = ModelRunner(module, sizing, seed=0, decode_graphs="eager",
                         decode_tables=DecodeTables(width, round_up=True))
    generator = torch.Generator().manual_seed(0)
    requests = []
    for index in range(num_requests):
        prompt = torch.randint(100, model.config.vocab_size, (context,),
                               generator=generator).tolist()
        request = RequestState(f"r{index}", prompt, 4, (), SamplingParams())
        request.block_ids = list(range(index * width, (index + 1) * width))
        requests.append(request)
    prefill = ScheduledBatch([ScheduledRequest(r, 0, r.num_tokens, True) for r in requests], [])
    _, result = runner.step(prefill)
    for request, token in zip(requests, result.token_ids):
        request.generated_tokens.append(token)
    decode = ScheduledBatch([ScheduledRequest(r, r.num_tokens - 1, 1, True) for r in requests],
                            [])
    inputs = runner._inputs(decode)
    graphs = runner.decode_graphs
    if not graphs.fits(inputs.meta, num_requests):
        raise SystemExit("this model's decode steps get no CUDA graphs (sliding-window "
                         "layers, or off the decode fast path): nothing to count")
    with torch.inference_mode():         # fills the static buffers, outside the count
        graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
    bucket = next(size for size in graphs.sizes if size >= num_requests)
    counter = OpCounter()
    with torch.inference_mode(), counter:
        graphs._forward(bucket, inputs.meta.block_table.shape[1])
    return counter.counts, len(module.layers)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.decode_ops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--context", type=int, default=100)
    args = parser.parse_args(argv)
    if os.environ.get("KVSERVE_NATIVE_KERNELS") != "0":
        # the native kernels would take the CPU's steps (and the switch is read once
        # per process): count in a child without them
        child = subprocess.run(
            [sys.executable, "-m", "bench.decode_ops", *(sys.argv[1:] if argv is None else argv)],
            env=dict(os.environ, KVSERVE_NATIVE_KERNELS="0"), cwd=Path(__file__).parents[1],
            capture_output=True, text=True)
        if child.returncode:
            raise SystemExit(f"bench.decode_ops failed:\n{child.stderr[-3000:]}")
        report = json.loads(child.stdout.strip().splitlines()[-1])
        print(json.dumps(report))
        return report
    counts, num_layers = decode_step_ops(args.model, args.dtype, args.requests, args.context)
    total = sum(counts.values())
    report = {"ops": total, "layers": num_layers, "ops_per_layer": round(total / num_layers, 1),
              "by_op": dict(counts.most_common())}
    print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
