"""Server settings: one flat, validated record built from a YAML file, the
environment and the CLI.

Precedence, lowest first: the defaults below, then the YAML file given with
`--config`, then the environment, then command-line flags. Keys in the file are the
flag names with underscores (`--max-batch-tokens` <-> `max_batch_tokens`);
`configs/default.yaml` lists them all. An unknown key or a bad value stops the server at start with a
message naming the field, before any model is loaded.

The engine knobs (page_size ... compile_level) default to None, meaning "let
the engine choose"; only the ones that are set reach `ContinuousBatchingConfig`.

Every field also has an environment variable, KVSERVE_ and its name in capitals
(`KVSERVE_PORT`, `KVSERVE_MAX_BATCH_TOKENS`; settings_env.py converts the text by the
field's type). It suits secrets that should not sit in a file or a process list
(`KVSERVE_API_KEY`, several keys separated by commas) and containers configured by
environment alone (docker/compose.yaml). A bad value's message names its variable.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Mapping

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.config import ContinuousBatchingConfig
from engine.loading.load_plan import DTYPE_NAMES
from engine.speculative.config import SpeculativeConfig

from .kv_events_config import KVEventsConfig
from .settings_env import EnvValueError, env_name, read_environment

DEFAULT_MODEL = "smollm2-135m-instruct"
# Routes answered without an API key by default: probes and scrapers carry none.
DEFAULT_OPEN_PATHS = ("/health", "/ready", "/metrics")

# Server setting name -> ContinuousBatchingConfig field name.
ENGINE_KNOBS = {
    "page_size": "page_size",
    "max_batch_tokens": "max_batch_tokens",
    "num_blocks": "num_blocks",
    "max_memory_percent": "max_memory_percent",
    "max_requests_per_batch": "max_requests_per_batch",
    "scheduler": "scheduler_type",
    "allow_block_sharing": "allow_block_sharing",
    "max_queue_size": "max_queue_size",
    "cpu_offload_space": "cpu_offload_space",
    "compile_level": "default_compile_level",
    "speculative_config": "speculative_config",
}


class SettingsError(ValueError):
    """A setting is unknown or invalid; the message names it."""


class ServerSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True,
                              protected_namespaces=())

    @property
    def model_spec(self) -> str:
        """What the engine loads: `model`, or `model:gguf_file` for a hub GGUF file."""
        return self.model if self.gguf_file is None else f"{self.model}:{self.gguf_file}"

    model: str = DEFAULT_MODEL
    """Model to serve: a built-in name, a local HF directory, a GGUF file, a hub id, or
    one GGUF file of a hub repository (`org/name:FILE.gguf`, or `gguf_file`)."""
    gguf_file: str | None = None
    """With a hub id as `model`: the GGUF file of that repository to serve."""
    served_model_name: str | None = None
    """Name clients put in `model`; defaults to `model`."""
    task: Literal["generate", "embed"] | None = None
    """"generate": the generation routes and /v1/embeddings; "embed": the embedding
    routes only (/v1/embeddings; /v1/rerank and /v1/score for a classifier). None:
    from the checkpoint (model_task.py): an encoder, a sequence classifier or a
    sentence-transformers checkpoint embeds, anything else generates."""
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_key: list[str] | None = None
    """Accepted keys; when set, requests must send `Authorization: Bearer <key>`
    with one of them (a single string is one key)."""
    open_paths: list[str] = Field(default_factory=lambda: list(DEFAULT_OPEN_PATHS))
    """Routes that need no API key even when keys are set."""
    dtype: Literal[DTYPE_NAMES] = "auto"
    """auto: on CPU a GGUF file's blocks with int8 activations (llama.cpp's way) where
    the CPU has an int8 vector loop, else float32 (exact); on GPUs the checkpoint's
    bf16/fp16, else bf16. float32 is the exact mode."""
    kv_cache_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    """KV cache element type: "auto" is bf16 with dtype bf16-weights, else fp32 on CPU
    and the model's dtype on GPUs; bf16 holds twice the tokens and halves what decode
    attention reads."""
    cpu_isa: Literal["native", "generic", "avx2", "avx_vnni", "avx512", "neon",
                     "dotprod"] = "native"
    """The highest instruction-set level the CPU kernels (and torch's own) may use:
    "native" is the CPU's best; a lower level runs exactly what a CPU of that level
    runs (engine/kernels/isa.py; docs/cpu-kernels.md). Also KVSERVE_CPU_ISA."""
    device: str = "auto"
    """"auto" (CUDA when available, else CPU), "cpu", "cuda" or "cuda:N"."""
    tp_size: int = Field(1, ge=1)
    """Tensor-parallel processes sharing the model; > 1 needs a launch with
    `torchrun --nproc-per-node <tp_size> -m server ...` (rank 0 serves HTTP)."""
    max_request_bytes: int = Field(4 * 1024 * 1024, ge=1024)
    """Largest accepted request body; bigger ones get 413. 4 MiB holds a prompt of
    about a million tokens of text, far past any context window served here."""
    request_timeout_s: float | None = Field(None, gt=0)
    """Longest a generation request may run; past it the request is cancelled (its KV
    blocks freed) and answered with a 504 error. None: no limit."""
    request_read_timeout_s: float = Field(30.0, gt=0)
    """A connection must deliver a complete request (head and body) within this long
    of opening or of its previous response; silent and trickling clients are cut."""
    stream_write_timeout_s: float | None = Field(30.0, gt=0)
    """A stream whose client reads nothing for this long is cancelled (its KV blocks
    freed). None: no limit."""
    max_connections: int | None = Field(None, ge=1)
    """Open client connections; past it the oldest one still waiting for its request
    is closed, or, when all are busy, the newcomer gets a 503. None: the file limit
    less a reserve."""
    malloc_arena_max: int | None = Field(2, ge=1)
    """glibc malloc arenas (server/memory.py); None: glibc's default, 8 per core."""
    malloc_trim_interval_s: float = Field(10.0, ge=0)
    """Seconds between hand-backs of the free memory inside glibc's arenas to the
    system (malloc_trim, server/memory.py); 0: never."""
    responses_store_size: int = Field(1000, ge=0)
    """Stored /v1/responses kept for previous_response_id, GET and DELETE (the oldest
    evicted; memory only); 0 stores none."""
    responses_store_ttl_s: float = Field(3600.0, gt=0)
    """Seconds a stored response is kept."""
    drain_timeout_s: float = Field(30.0, ge=0)
    """On SIGTERM/SIGINT, how long in-flight requests may run before they are cut."""
    log_level: Literal["critical", "error", "warning", "info", "debug"] = "info"
    log_prompts: bool = False
    """Add prompt and output text to the per-request log line (off: never logged)."""
    cors_allow_origins: list[str] = Field(default_factory=list)
    """Browser origins allowed to call the API (e.g. a web chat UI); ["*"] for any."""
    allowed_hosts: list[str] = Field(default_factory=list)
    """Host names served besides the loopback ones on a loopback bind (all of them on
    other binds unless this lists some): a guard against DNS rebinding."""
    web_ui: bool = True
    """Serve the built-in chat page at / (server/web_ui.py): the page and its static
    files need no key; the page asks for one when the API does. Off: / is a 404."""
    chat_template: str | None = None
    """A Jinja chat template file that replaces the model's own."""
    parse_special_tokens_in_messages: bool = False
    """Message text that spells a control token (`<|im_start|>system`) becomes that
    token. Off (the default): it is tokenized as the text it is, so a user cannot
    forge role turns."""
    tool_parser: Literal["auto", "generic", "hermes", "llama3_json", "mistral"] = "auto"
    """How tools are shown to the model and its calls read back; "auto" picks the
    family from the chat template (server/text_pipeline/tool_formats.py)."""

    page_size: int | None = None
    max_batch_tokens: int | None = None
    num_blocks: int | None = None
    max_memory_percent: float | None = None
    max_requests_per_batch: int | None = None
    scheduler: Literal["fifo", "prefill_first"] | None = None
    allow_block_sharing: bool | None = None
    max_queue_size: int | None = None
    cpu_offload_space: float | None = None
    compile_level: int | None = Field(None, ge=0, le=3)
    speculative_config: str | None = None
    """Speculative decoding in vLLM's shape, as JSON text (in the YAML file too), e.g.
    '{"method": "ngram", "num_speculative_tokens": 4}' (engine/speculative/config.py)."""

    kv_events_config: str | None = None
    """KV cache events for KV-aware routers, in vLLM's shape, as JSON text (in the YAML
    file too), e.g. '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557"}'
    (server/kv_events_config.py, docs/kv-events.md)."""

    enable_fault_injection: bool = False
    """Testing only: adds POST /debug/fail-engine, which makes the engine thread die
    at its next step. Never turn it on in a deployment."""

    @field_validator("speculative_config")
    @classmethod
    def _speculation_reads(cls, value: str | None) -> str | None:
        SpeculativeConfig.from_any(value)          # raises naming the key
        return value

    @field_validator("kv_events_config")
    @classmethod
    def _kv_events_read(cls, value: str | None) -> str | None:
        KVEventsConfig.from_any(value)             # raises naming the key
        return value

    @field_validator("api_key", mode="before")
    @classmethod
    def _one_key_is_a_list(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @field_validator("api_key")
    @classmethod
    def _keys_not_empty(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and (not value or any(not key.strip() for key in value)):
            raise ValueError("API keys must be non-empty strings")
        return value

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    def continuous_batching_config(self) -> ContinuousBatchingConfig:
        knobs = {engine_name: getattr(self, name) for name, engine_name in ENGINE_KNOBS.items()
                 if getattr(self, name) is not None}
        return ContinuousBatchingConfig(**knobs)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The YAML mapping in `path` ({} for an empty file)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise SettingsError(f"config file {path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"config file {path} must hold a mapping of setting: value")
    return {str(k).replace("-", "_"): v for k, v in data.items()}


def env_values(environ: Mapping[str, str]) -> dict[str, Any]:
    """Settings taken from the environment's KVSERVE_<FIELD> variables, converted by
    each field's type (settings_env.py); SettingsError names a bad variable."""
    try:
        return read_environment(ServerSettings.model_fields, environ)
    except EnvValueError as exc:
        raise SettingsError(f"invalid setting '{exc.field}' from {exc.variable}: "
                            f"{exc.reason}") from None


def build_settings(file_values: dict[str, Any], cli_values: dict[str, Any],
                   environ: Mapping[str, str] | None = None) -> ServerSettings:
    """Merge file, environment and CLI values (later wins) and validate, naming any
    bad field, and its variable when the environment gave it."""
    from_env = env_values(environ or {})
    from_cli = {k: v for k, v in cli_values.items() if v is not None}
    merged = {**file_values, **from_env, **from_cli}
    origin = {name: f" from {env_name(name)}" for name in from_env if name not in from_cli}
    try:
        settings = ServerSettings.model_validate(merged)
    except ValidationError as exc:
        error = exc.errors(include_url=False)[0]
        loc = ".".join(str(p) for p in error["loc"])
        if error["type"] == "extra_forbidden":
            raise SettingsError(f"unknown setting '{loc}'") from None
        message = error["msg"].removeprefix("Value error, ")
        if loc:
            where = origin.get(str(error["loc"][0]), "")
            raise SettingsError(f"invalid setting '{loc}'{where}: {message}") from None
        raise SettingsError(f"invalid settings: {message}") from None
    _check_engine_knobs(settings, origin)
    return settings


def _check_engine_knobs(settings: ServerSettings, origin: Mapping[str, str]) -> None:
    """Let the engine's own config validate the knobs now, not after a model load.
    Its messages read "ContinuousBatchingConfig.<field>: ..."; name our key instead
    (and its variable: `origin` maps the fields the environment set to " from VAR")."""
    try:
        settings.continuous_batching_config()
    except ValueError as exc:
        message = str(exc)
        for name, engine_name in ENGINE_KNOBS.items():
            prefix = f"ContinuousBatchingConfig.{engine_name}: "
            if message.startswith(prefix):
                raise SettingsError(f"invalid setting '{name}'{origin.get(name, '')}: "
                                    f"{message[len(prefix):]}") from None
        raise SettingsError(f"invalid engine settings: {message}") from None
