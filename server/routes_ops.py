"""Operational routes: the probes of an orchestrator and the metrics scrape.

    GET /health   200 {"status": "ok", ...engine stats} while the engine thread runs;
                  503 once it has died. For liveness: restart the container when red.
    GET /ready    200 once the model is loaded and warmed up; 503 while draining on
                  shutdown or when the engine is dead. For readiness: route traffic
                  here only when green.
    GET /metrics  Prometheus text format (see metrics.py).

They sit behind the same API-key check as the rest, but their paths are in the
default `open_paths`, so probes and scrapers need no key.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Depends, Request, Response
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import JSONResponse

from .edge.auth import require_api_key
from .edge.errors import OpenAIError
from .fault_injection import arm_engine_fault
from .metrics import CONTENT_TYPE
from .openapi_document import openapi_document
from .state import ServingState

logger = logging.getLogger(__name__)

ops = APIRouter(dependencies=[Depends(require_api_key)])


@ops.get("/openapi.json", include_in_schema=False)
async def openapi_schema(request: Request) -> JSONResponse:
    return JSONResponse(openapi_document(request.app))


@ops.get("/docs", include_in_schema=False)
async def swagger_docs(request: Request) -> Response:
    return get_swagger_ui_html(openapi_url="/openapi.json", title="kvserve API")


@ops.get("/redoc", include_in_schema=False)
async def redoc_docs(request: Request) -> Response:
    return get_redoc_html(openapi_url="/openapi.json", title="kvserve API")


def _state(request: Request) -> ServingState:
    return request.app.state.serving


@ops.get("/health")
async def health(request: Request) -> JSONResponse:
    engine = _state(request).engine
    if not engine.is_running():
        return OpenAIError("The engine is not running.", status_code=503,
                           code="engine_stopped").to_response()
    return JSONResponse({"status": "ok", "draining": engine.draining, **engine.stats()})


@ops.get("/ready")
async def ready(request: Request) -> JSONResponse:
    engine = _state(request).engine
    if engine.ready():
        return JSONResponse({"status": "ready"})
    reason = ("draining" if engine.draining else
              "engine_stopped" if not engine.is_running() else "warming_up")
    return OpenAIError(f"The server is not ready: {reason}.", status_code=503,
                       code=reason).to_response()


@ops.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(_state(request).metrics.render(), media_type=CONTENT_TYPE)


debug = APIRouter(dependencies=[Depends(require_api_key)], include_in_schema=False)
"""Routed only when `enable_fault_injection` is on (create_app): never in production."""


@debug.post("/debug/fail-engine")
async def fail_engine(request: Request) -> JSONResponse:
    """Testing only (see fault_injection.py)."""
    state = _state(request)
    logger.warning("arming an engine fault on request: the engine thread will die")
    arm_engine_fault(state.engine.manager)
    return JSONResponse({"status": "armed"})
