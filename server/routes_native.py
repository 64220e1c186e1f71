"""SGLang-native routes: /generate (POST and PUT), /abort_request, /flush_cache (http_api.md §1, §3); the info,
pool and utility routes of `server.routes_admin` are included in this router."""

from __future__ import annotations

import json
import logging
import time
from functools import partial

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from engine.runtime.request import RequestOutput
from server.errors import sse_error
from server.native import NativeShaper, plan_generate
from server.protocol import AbortReq, GenerateReqInput
from server.routes_admin import router as admin_router
from server.state import server_state
from server.submission import CLIENT_CLOSED, ClientGone, SSEResponse, Submission, sse_frames

logger = logging.getLogger(__name__)
router = APIRouter()
router.include_router(admin_router)

FLUSH_NOTE = ("\nPlease check backend logs for more details. (When there are running or waiting requests, the "
              "operation will not be performed.)\n")


@router.put("/generate", operation_id="generate_put")
@router.post("/generate", operation_id="generate")
async def generate(body: GenerateReqInput, request: Request) -> Response:
    """Text or token ids in; one object (single prompt, n=1) or a list out; SSE with `stream`."""
    started = time.monotonic()
    state = server_state(request)
    args = state.args
    plan = plan_generate(body, state.engine.tokenizer, args.engine.max_new_tokens_cap)
    sub = Submission(state.async_engine, plan.reqs, "/generate", started)  # 400 / 503 before anything starts
    shaper = NativeShaper(plan, state.engine.tokenizer, args.incremental_streaming_output, started)
    if plan.stream:
        def frame(i: int, out: RequestOutput) -> str | None:
            body = shaper.frame(i, out, sub.joined[i])
            return None if body is None else f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        return SSEResponse(sse_frames(sub, frame, partial(sse_error, "/generate")), sub)
    try:
        joined = await sub.collect(request)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    bodies = [shaper.body(i, res) for i, res in enumerate(joined)]
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
        return PlainTextResponse("Cache flushed." + FLUSH_NOTE)
    logger.warning("cache not flushed: requests are running or waiting")
    return PlainTextResponse("Cache not flushed." + FLUSH_NOTE, status_code=400)
