"""ServingState: what every route needs, built once when the server starts.

The lifespan in `server/app.py` loads the model, starts the engine and stores one
ServingState on `app.state.serving`; routes read it and never reach into the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from engine import Pooling
from engine.encoder import EncoderModel

from .async_engine import AsyncEngine
from .embeddings.embedding_pooling import checkpoint_pooling
from .text_pipeline.chat_format import ChatFormat, build_chat_format
from .edge.errors import bad_request, model_not_found
from .metrics import ServerMetrics, cache_config_labels
from .model_task import serving_task
from .openai_api.responses_store import ResponseStore
from .settings import ServerSettings
from .text_pipeline.token_text import TokenTexts


def eos_list(value: Any) -> list[int]:
    """An eos_token_id as stored by configs (None, int or list) -> list of ints."""
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


@dataclass
class ServingState:
    settings: ServerSettings
    engine: AsyncEngine
    tokenizer: Any
    max_model_len: int
    """Longest prompt + completion served, in tokens: the model's context window, or
    the KV cache's capacity when that is smaller (a longer request could never be
    scheduled). vLLM's `max_model_len` means the same."""
    vocab_size: int
    eos_token_ids: list[int]
    """Tokens that end a completion unless the request sets ignore_eos."""
    token_texts: TokenTexts
    chat_format: ChatFormat
    """The chat template, the tool-call family and reasoning support (chat_format.py)."""
    metrics: ServerMetrics | None = None
    embedding_pooling: Pooling = field(default_factory=Pooling)
    """How /v1/embeddings pools (embedding_pooling.py)."""
    task: str = "generate"
    """"generate", or "embed": the generation routes answer 400 (model_task.py)."""
    num_labels: int | None = None
    """The labels of the model's sequence-classification head, None where it has none
    (then /v1/rerank and /v1/score answer 400: serving_rerank.py)."""
    responses: ResponseStore = field(default_factory=lambda: ResponseStore(0, 1.0))
    """Stored /v1/responses (responses_store.py); build_state sizes it from settings."""
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def model_name(self) -> str:
        return self.settings.model_name

    def check_generates(self) -> None:
        """400 on a generation route when the server only embeds (task "embed")."""
        if self.task == "embed":
            routes = "/v1/embeddings, /v1/rerank and /v1/score" if self.num_labels is not None \
                else "/v1/embeddings"
            raise bad_request(f"The model '{self.model_name}' is served as an embedding model "
                              f"(task 'embed'): it answers {routes}, not text generation.",
                              param="model", code="embedding_model")

    def check_model(self, requested: str | None) -> str:
        """The name to echo in responses; 404 for a model this server does not serve.
        A missing `model` means the served one (as vLLM does)."""
        if requested is None:
            return self.model_name
        if requested not in (self.model_name, self.settings.model):
            raise model_not_found(requested)
        return requested


def _cache_config(settings: ServerSettings, sizing: Any) -> dict[str, str] | None:
    """vllm:cache_config_info's labels; None for a model without a KV cache."""
    if sizing is None:
        return None
    config = settings.continuous_batching_config()
    return cache_config_labels(sizing.page_size, sizing.num_blocks, settings.kv_cache_dtype,
                               config.allow_block_sharing, config.cpu_offload_space or 0.0)


def build_state(settings: ServerSettings, model: Any, engine: AsyncEngine) -> ServingState:
    """Read what the routes need from a loaded engine model."""
    config = model.config
    vocab_size = int(config.vocab_size)
    tokenizer = model.tokenizer
    max_len = getattr(config, "max_position_embeddings", None) or 2048
    eos = eos_list(getattr(model.generation_config, "eos_token_id", None))
    if not eos and getattr(tokenizer, "eos_token_id", None) is not None:
        eos = [int(tokenizer.eos_token_id)]
    sizing = getattr(engine.manager, "sizing", None)
    cached = int(getattr(sizing, "max_cached_tokens", max_len))
    return ServingState(settings=settings, engine=engine, tokenizer=tokenizer,
                        max_model_len=min(int(max_len), cached), vocab_size=vocab_size,
                        eos_token_ids=eos, token_texts=TokenTexts(tokenizer),
                        chat_format=build_chat_format(
                            tokenizer, settings.chat_template, settings.tool_parser,
                            settings.parse_special_tokens_in_messages),
                        metrics=ServerMetrics(engine, settings.model_name,
                                              _cache_config(settings, sizing)),
                        embedding_pooling=checkpoint_pooling(
                            settings.model, encoder=isinstance(model, EncoderModel)),
                        num_labels=engine.manager.num_labels,
                        task=serving_task(settings.task, model, settings.model),
                        responses=ResponseStore(settings.responses_store_size,
                                                settings.responses_store_ttl_s))
