"""The FastAPI application and its lifespan.

    startup:   load the model (in a worker thread: it takes seconds) -> build the
               manager from the settings' engine knobs -> start the engine thread
               -> warm it up -> publish a ServingState on app.state.serving
               (with `kv_events_config`, the KV event publisher opens first)
    serving:   routes.py (the API), routes_ops.py (health, ready, metrics),
               web_ui.py (the chat page at /, unless web_ui is off); every
               request passes RequestLogMiddleware (one log line each)
    shutdown:  hard-stop the engine (uvicorn has already drained open connections
               for the drain timeout, see lifecycle.py), then free the cache and
               close the KV event publisher
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
from typing import Any, AsyncIterator

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from engine.manager import ContinuousBatchingManager

from .async_engine import AsyncEngine
from .edge.browser_safety import BrowserSafety
from .edge.connections import quiet_accept_errors
from .edge.errors import install_error_handlers
from .kv_event_publisher import KVEventPublisher, PublisherCollector, open_publisher
from .memory import AllocatorTrimmer
from .model_task import serving_task
from .request_log import RequestLogMiddleware
from .routes import api
from .routes_ops import debug, ops
from .settings import ServerSettings
from .state import build_state
from .web_ui import web

logger = logging.getLogger(__name__)


def resolve_device(device: str) -> str:
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_engine_model(settings: ServerSettings) -> Any:
    from engine import load_model

    model = load_model(settings.model_spec, dtype=settings.dtype,
                       device=resolve_device(settings.device), progress=False,
                       tp_size=settings.tp_size, kv_cache_dtype=settings.kv_cache_dtype)
    if model.tokenizer is None:
        raise RuntimeError(f"model {settings.model!r} has no tokenizer; the server needs one")
    serving_task(settings.task, model, settings.model)    # a conflict stops the start
    return model


CPU_MAX_BATCH_TOKENS = 2048
"""Tokens per forward pass of a server on CPU when `max_batch_tokens` is not set (the
engine's own default is 8192). One step holds every stream: on two cores a long
prompt taken in one step freezes the streams beside it for its whole prefill. In
steps of 2048 their longest gap is much shorter and the prompt's TTFT about the same
(docs/benchmarks.md, Long prompts), and throughput at c=32 and c=64 is unchanged. GPUs
prefill 8192 tokens in tens of milliseconds: the engine's default stands there."""


def engine_config(settings: ServerSettings, device_type: str) -> Any:
    """The ContinuousBatchingConfig of the server's manager on `device_type`."""
    # The server sends per-request sampling parameters, hence per_request_processors.
    cb_config = settings.continuous_batching_config().replace(per_request_processors=True)
    if settings.max_batch_tokens is None and device_type == "cpu":
        cb_config = cb_config.replace(max_batch_tokens=CPU_MAX_BATCH_TOKENS)
    return cb_config


def init_manager(settings: ServerSettings, model: Any) -> Any:
    """The engine's manager for `settings` (on every tensor-parallel rank alike)."""
    return model.init_continuous_batching(
        generation_config=model.generation_config,
        continuous_batching_config=engine_config(settings, model.device.type))


def start_engine(settings: ServerSettings, model: Any,
                 kv_events: KVEventPublisher | None = None) -> AsyncEngine:
    """The started engine; `kv_events` receives its prefix cache's events from the
    first step on (an embedding model's manager has no KV cache, so none)."""
    manager = init_manager(settings, model)
    if kv_events is not None and isinstance(manager, ContinuousBatchingManager):
        manager.publish_kv_events(kv_events.submit)
    engine = AsyncEngine(manager)
    engine.start()
    return engine


def create_app(settings: ServerSettings, model: Any = None) -> FastAPI:
    """The server for `settings`. `model` may be an already loaded EngineModel (the
    app then starts its own manager on it); otherwise the lifespan loads one."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        quiet_accept_errors(asyncio.get_running_loop())
        loaded = model if model is not None else await asyncio.to_thread(load_engine_model, settings)
        kv_events = open_publisher(settings.kv_events_config)
        engine = start_engine(settings, loaded, kv_events)
        await asyncio.to_thread(engine.warmup)
        app.state.serving = build_state(settings, loaded, engine)
        if kv_events is not None:
            app.state.serving.metrics.registry.register(
                PublisherCollector(kv_events, settings.model_name))
        # What start-up made lives as long as the server: out of the collector's way,
        # or every full collection while serving walks it (~350k objects, with the
        # interpreter lock held: a pause in every stream).
        gc.collect()
        gc.freeze()
        trimmer = AllocatorTrimmer(settings.malloc_trim_interval_s)
        trimmer.start()
        logger.info("serving %s as %r (max_model_len %d tokens)", settings.model,
                    settings.model_name, app.state.serving.max_model_len)
        try:
            yield
        finally:
            await trimmer.stop()
            await asyncio.to_thread(engine.shutdown)
            if kv_events is not None:
                await asyncio.to_thread(kv_events.close)

    # the API docs are routes of ours, behind the API key (routes_ops.py); no
    # trailing-slash redirects (their Location would come from the client's Host)
    app = FastAPI(title="kvserve", version="0.1.0", lifespan=lifespan, openapi_url=None,
                  docs_url=None, redoc_url=None, redirect_slashes=False)
    if settings.cors_allow_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_allow_origins,
                           allow_methods=["*"], allow_headers=["*"])
    app.add_middleware(BrowserSafety, bind_host=settings.host,
                       allowed_hosts=settings.allowed_hosts)
    # Added last, so it wraps CORS too: every response, preflights included, is logged.
    app.add_middleware(RequestLogMiddleware, log_prompts=settings.log_prompts)
    install_error_handlers(app)
    app.include_router(api)
    app.include_router(ops)
    if settings.web_ui:
        app.include_router(web)
    if settings.enable_fault_injection:
        app.include_router(debug)
    return app
