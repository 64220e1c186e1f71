"""SGLang-native routes: /generate (POST and PUT), /abort_request, /flush_cache (http_api.md §1, §3).

Info, health, tokenizer and metrics routes live in `server.routes_admin`; this router includes them.
"""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from server.generate_inputs import plan_generate
from server.generate_run import ClientGone, GenerationRun, SSEResponse
from server.protocol import AbortReq, GenerateReqInput
from server.routes_admin import router as admin_router
from server.state import ServerState

logger = logging.getLogger(__name__)
router = APIRouter()
router.include_router(admin_router)

FLUSHED = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
           "requests, the operation will not be performed.)\n")
NOT_FLUSHED = ("Cache not flushed.\nPlease check backend logs for more details. (When there are running or "
               "waiting requests, the operation will not be performed.)\n")
CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never seen by anyone


def server_state(request: Request) -> ServerState:
    return request.app.state.server


@router.put("/generate", operation_id="generate_put")
@router.post("/generate", operation_id="generate")
async def generate(body: GenerateReqInput, request: Request) -> Response:
    """Text or token ids in; one object (single prompt, n=1) or a list out; SSE with `stream`."""
    started = time.monotonic()
    state = server_state(request)
    plan = plan_generate(body, state.engine, state.args)  # ValueError -> 400 before anything starts
    run = GenerationRun(state, plan, started)
    run.submit()  # EngineDeadError -> 503 while shutting down
    if plan.stream:
        return SSEResponse(run.events(), on_close=run.close)
    try:
        bodies = await run.results(request)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    finally:
        run.close()  # aborts whatever did not finish (cancelled, client gone, server error)
    return JSONResponse(bodies[0] if plan.single else bodies)


@router.post("/abort_request")
async def abort_request(body: AbortReq, request: Request) -> Response:
    """Abort by rid (also its `rid_*` samples) or everything; an empty rid alone aborts nothing."""
    if body.abort_all or body.rid:
        server_state(request).async_engine.abort(body.rid, body.abort_all)
    return Response(status_code=200)


@router.post("/flush_cache", operation_id="flush_cache_post")
@router.get("/flush_cache", operation_id="flush_cache")
async def flush_cache(request: Request) -> Response:
    """Drop the prefix cache; refused with 400 while requests are queued or running."""
    state = server_state(request)
    if state.async_engine.num_in_flight() == 0 and state.engine.flush_cache():
        logger.info("prefix cache flushed")
        return PlainTextResponse(FLUSHED)
    logger.warning("cache not flushed: requests are running or waiting")
    return PlainTextResponse(NOT_FLUSHED, status_code=400)
