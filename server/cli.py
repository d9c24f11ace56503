"""Command line of `python -m server`: flags mirror the settings one to one.

    python -m server --model smollm2-135m-instruct --port 8000 --page-size 32

Every flag defaults to None ("not given") so that only flags actually typed override
the config file; the real defaults live in `ServerSettings`.
"""

from __future__ import annotations

import argparse
import os
from typing import Any, Mapping

from .settings import ServerSettings, build_settings, read_config_file
from .settings_env import env_name


def _bool(text: str) -> bool:
    lowered = text.lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m server",
        description="OpenAI-compatible HTTP server over the kvserve engine.",
        epilog="Every setting can also come from its environment variable, KVSERVE_ and "
               "the setting in capitals, shown as [env ...] after each flag. Lists are "
               "comma-separated, booleans 1/0, true/false, yes/no or on/off, `none` "
               "clears an optional value; an empty variable counts as unset. "
               "Precedence, lowest first: defaults, the --config file, the environment, "
               "flags.",
        argument_default=None)
    _model_flags(parser.add_argument)
    _http_flags(parser.add_argument_group("http", "connections, limits, logging, browsers"))
    _text_flags(parser.add_argument_group("text", "chat templates and tool calls"))
    _engine_flags(parser.add_argument_group("engine",
                                            "continuous batching (default: engine's choice)"))
    testing = parser.add_argument_group("testing")
    testing.add_argument("--enable-fault-injection", type=_bool, metavar="BOOL",
                         help="add POST /debug/fail-engine (kills the engine thread)")
    for action in parser._actions:     # each setting's flag names its variable
        if action.dest in ServerSettings.model_fields and action.help:
            off = "=0" if action.const is False else ""     # a --no-... flag
            action.help += f" [env {env_name(action.dest)}{off}]"
    return parser


def _model_flags(add) -> None:
    """What to serve and where: the model and its name, the address and keys, the
    dtype, device, kernel ISA and tensor parallelism."""
    add("--config", help="YAML file of settings (see configs/default.yaml)")
    add("--model", help="model: built-in name, HF directory, GGUF file or hub id")
    add("--gguf-file", help="with a hub id as --model: the repository's GGUF file to serve")
    add("--served-model-name", help="name clients send as `model` (default: --model)")
    add("--task", help="generate or embed (embedding routes only); default: embed for "
                       "encoders, classifiers and sentence-transformers checkpoints")
    add("--host", help="address to bind (default 127.0.0.1)")
    add("--port", type=int, help="port to bind (default 8000)")
    add("--api-key", nargs="+", metavar="KEY",
        help="require `Authorization: Bearer KEY` with one of these keys "
             "(KVSERVE_API_KEY=key1,key2 keeps them out of the process list)")
    add("--open-paths", nargs="*", metavar="PATH",
        help="routes reachable without a key (default /health /ready /metrics)")
    add("--dtype", help="auto, float32, bfloat16, float16, bf16-weights (bf16 weights in "
                        "the compute-bound matmuls and a bf16 KV cache, fp32 activations "
                        "and small decode steps: the fast CPU mode, closer to fp32 than "
                        "bfloat16) "
                        ", int8-weights (int8 weights, bf16 activations: lowest latency for "
                        "a few streams, least accurate) or int8-activations (a GGUF's blocks "
                        "against int8 activations, as llama.cpp: the fastest GGUF mode on "
                        "CPUs with AVX512-VNNI)")
    add("--kv-cache-dtype", help="auto (bf16 with bf16-weights, else fp32 on CPU), float32 "
                                 "or bfloat16")
    add("--device", help="auto, cpu, cuda or cuda:N")
    add("--cpu-isa", help="highest instruction-set level of the CPU kernels: native (the "
                          "CPU's best), generic, avx2, avx_vnni, avx512; on ARM generic, "
                          "neon, dotprod (docs/cpu-kernels.md)")
    add("--tp-size", type=int, help="tensor-parallel processes (launch with torchrun "
                                     "--nproc-per-node TP_SIZE -m server ...)")


def _http_flags(group) -> None:
    add = group.add_argument
    add("--max-request-bytes", type=int, help="largest request body accepted")
    add("--request-timeout", dest="request_timeout_s", type=float,
        help="seconds a generation may run before it is cancelled (504)")
    add("--request-read-timeout", dest="request_read_timeout_s", type=float,
        help="seconds a connection has to send a complete request (default 30)")
    add("--stream-write-timeout", dest="stream_write_timeout_s", type=float,
        help="seconds a stream may wait for a client that reads nothing (default 30)")
    add("--max-connections", type=int,
        help="open client connections (default: the file limit less a reserve)")
    add("--malloc-arena-max", type=int, help="glibc malloc arenas (default 2)")
    add("--malloc-trim-interval", dest="malloc_trim_interval_s", type=float,
        help="seconds between returns of free heap memory to the system (default 10, 0 = off)")
    add("--responses-store-size", type=int,
        help="stored /v1/responses kept for previous_response_id (default 1000, 0 = none)")
    add("--responses-store-ttl", dest="responses_store_ttl_s", type=float,
        help="seconds a stored response is kept (default 3600)")
    add("--drain-timeout", dest="drain_timeout_s", type=float,
        help="seconds in-flight requests may finish after SIGTERM (default 30)")
    add("--log-level", help="critical, error, warning, info or debug")
    add("--log-prompts", type=_bool, metavar="BOOL",
        help="add prompt and output text to the request log lines (default false)")
    add("--cors-allow-origins", nargs="+", metavar="ORIGIN",
        help="browser origins allowed to call the API ('*' for any)")
    add("--allowed-hosts", nargs="+", metavar="HOST",
        help="Host header names served besides loopback ones (DNS-rebinding guard)")
    add("--no-web-ui", dest="web_ui", action="store_false", default=None,
        help="do not serve the built-in chat page at /")


def _text_flags(group) -> None:
    add = group.add_argument
    add("--chat-template", metavar="FILE", help="a Jinja chat template replacing the model's")
    add("--parse-special-tokens-in-messages", type=_bool, metavar="BOOL",
        help="let message text that spells a control token become it (default false)")
    add("--tool-parser", help="auto (from the chat template), generic, hermes, llama3_json "
                              "or mistral")


def _engine_flags(group) -> None:
    add = group.add_argument
    add("--page-size", type=int, help="tokens per KV page")
    add("--max-batch-tokens", type=int, help="token budget of one forward pass")
    add("--num-blocks", type=int, help="number of KV cache blocks")
    add("--max-memory-percent", type=float,
        help="share of free memory for the KV cache, in (0, 1]")
    add("--max-requests-per-batch", type=int, help="cap on requests per step")
    add("--scheduler", help="fifo or prefill_first")
    add("--allow-block-sharing", type=_bool, help="prefix caching (true/false)")
    add("--max-queue-size", type=int, help="max waiting requests (0 = no cap)")
    add("--cpu-offload-space", type=float,
        help="GiB of CPU memory for the KV of preempted requests (0 = recompute)")
    add("--compile-level", type=int,
        help="torch.compile of decoder layers on GPUs, 0-3 (0 = off)")
    add("--speculative-config", metavar="JSON",
        help='speculative decoding, e.g. \'{"method": "ngram", '
             '"num_speculative_tokens": 4, "prompt_lookup_max": 4, '
             '"prompt_lookup_min": 2}\'')
    add("--kv-events-config", metavar="JSON",
        help='publish KV cache events for KV-aware routers (vLLM\'s format), e.g. '
             '\'{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
             '"replay_endpoint": "tcp://*:5558"}\'')


def parse_settings(argv: list[str] | None = None,
                   environ: Mapping[str, str] | None = None) -> ServerSettings:
    """Flags (and the file named by --config, and the KVSERVE_<FIELD> variables of
    `environ`, default os.environ) -> validated settings.

    Raises SettingsError naming the bad field; argparse itself exits on a malformed
    flag value such as `--port abc`.
    """
    args: dict[str, Any] = vars(build_parser().parse_args(argv))
    config_path = args.pop("config")
    file_values = read_config_file(config_path) if config_path else {}
    return build_settings(file_values, args, os.environ if environ is None else environ)
