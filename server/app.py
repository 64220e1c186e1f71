"""`create_app(state)`: the FastAPI app, its error envelopes, API-key check, body limit and lifespan."""

import asyncio
import hmac
import logging
import time
import uuid
from collections.abc import Iterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.async_engine import EngineDeadError
from server.errors import ApiError, error_response, media_type, not_json_message
from server.openai_protocol import document_request_bodies
from server.routes_native import router as native_router
from server.routes_openai import router as openai_router
from server.state import ServerState
from server.submission import log_access

logger = logging.getLogger(__name__)
OPEN_PATHS = ("/health", "/liveness")  # reachable without the API key (kubelet probes)


def _validation_message(exc: RequestValidationError, content_type: str) -> str:
    if (media := media_type(content_type)) != "application/json" and not media.endswith("+json") and any(
            tuple(err.get("loc", ())) == ("body",) and isinstance(err.get("input"), bytes) for err in exc.errors()):
        return not_json_message(content_type)  # NOTE: FastAPI validates a body of another declared type as raw bytes
    parts = []
    for err in exc.errors():
        loc = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
        msg = str(err.get("msg", "invalid value")).removeprefix("Value error, ")
        kind = err.get("type", "value_error")  # pydantic's own checks carry their type, as vLLM's messages do
        parts.append(f"{loc or 'body'}: {msg}" + ("" if kind == "value_error" else f" [type={kind}]"))
    return "Invalid request: " + "; ".join(parts)


def refused(request: Request, status: int, message: str, extra: dict | None = None, headers: dict | None = None,
            logged: bool = False) -> JSONResponse:
    """An exception handler's error response, and its access-log line (unless its Submission wrote one)."""
    if not logged:
        started = request.scope.get("state", {}).get("started", time.monotonic())
        log_access("-", "-", 0, time.monotonic() - started, status, "error", request.url.path)
    return error_response(request, status, message, extra, headers)


class BodyLimit:
    """Refuse bodies over `limit` bytes with 413 before anything parses them: a declared Content-Length at once,
    otherwise as soon as the body (chunked or not), read here, passes the limit; the app then gets it in one
    message, and later `receive` calls (the disconnect) go to the client. NOTE: reading here, not inside the app,
    is what makes a chunked body a 413 on every route: FastAPI turns any error while it reads a body into a 400."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope.setdefault("state", {})["started"] = time.monotonic()  # the access log's latency
        path, length = scope.get("path", ""), dict(scope.get("headers") or []).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.limit:
            return await self._refuse(path, send)
        chunks, seen, more = [], 0, True
        while more:
            if (msg := await receive())["type"] != "http.request":  # the client left before sending its whole body
                return
            chunks.append(msg.get("body", b""))
            if (seen := seen + len(chunks[-1])) > self.limit:
                return await self._refuse(path, send)
            more = msg.get("more_body", False)
        whole: Iterator[Message] = iter([{"type": "http.request", "body": b"".join(chunks), "more_body": False}])

        async def replay() -> Message:
            return next(whole, None) or await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, path: str, send: Send) -> None:
        resp = error_response(path, 413, f"request body exceeds {self.limit} bytes (--max-request-bytes)",
                              headers={"Connection": "close"})
        await resp({"type": "http"}, None, send)  # type: ignore[arg-type]


class ApiKeyAuth:
    """Require `Authorization: Bearer <key>` on every route but OPEN_PATHS (401 in the path's envelope). NOTE: pure
    ASGI, not `@app.middleware("http")`: routes still see the client's disconnect, and streams pass untouched."""

    def __init__(self, app: ASGIApp, key: str) -> None:
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("path", "") not in OPEN_PATHS:
            if not hmac.compare_digest(dict(scope.get("headers") or []).get(b"authorization", b""), self.expected):
                resp = error_response(scope.get("path", ""), 401, "Unauthorized: missing or wrong API key "
                                      "(send 'Authorization: Bearer <key>')")
                return await resp(scope, receive, send)
        await self.app(scope, receive, send)


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        state.async_engine.start(asyncio.get_running_loop())
        state.ready = True
        yield
        await state.async_engine.drain(state.args.shutdown_grace_period)  # at once if SIGTERM has drained it
        state.async_engine.stop()

    app = FastAPI(title="minimax-microserver", lifespan=lifespan)
    app.state.server = state

    async def on_error(request: Request, exc: Exception) -> JSONResponse:
        """Every error in its path's envelope: 400 for bad input, ApiError's or HTTPException's status, 503 for a
        dead engine, 500 for anything else (a server bug: logged with its traceback under an id the client gets)."""
        if isinstance(exc, RequestValidationError):
            return refused(request, 400, _validation_message(exc, request.headers.get("content-type", "")))
        if isinstance(exc, ApiError):
            return refused(request, exc.status, exc.message, exc.extra, logged=exc.logged)
        if isinstance(exc, StarletteHTTPException):
            return refused(request, exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))
        if isinstance(exc, EngineDeadError):
            return refused(request, 503, str(exc))
        rid = uuid.uuid4().hex
        logger.error("internal error (request id %s) on %s", rid, request.url.path, exc_info=exc)
        return refused(request, 500, f"internal server error: {type(exc).__name__} (request id {rid})",
                       headers={"X-Request-Id": rid})

    for exc_type in (RequestValidationError, ApiError, EngineDeadError, StarletteHTTPException, Exception):
        app.add_exception_handler(exc_type, on_error)

    @app.get("/health")
    async def health(request: Request) -> Response:
        if state.async_engine.warming and state.ready:
            return error_response(request, 503, "warming up: compiling the decode graphs (see the log)")
        return Response(status_code=200 if state.healthy else 503)

    @app.get("/liveness")
    async def liveness() -> Response:
        """200 while the process serves HTTP, draining included (/health is 503 then): the liveness probe."""
        return Response(status_code=200)

    app.include_router(native_router)
    app.include_router(openai_router)
    document_request_bodies(app.openapi())  # NOTE: FastAPI caches the document: /openapi.json serves it amended
    # NOTE: last added runs first: CORS (preflights need no key), the API key (no body read without it), the body limit.
    app.add_middleware(BodyLimit, limit=state.args.max_request_bytes)
    if state.args.api_key:
        app.add_middleware(ApiKeyAuth, key=state.args.api_key)
    if state.args.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=state.args.cors_origins, allow_methods=["*"],
                           allow_headers=["*"])
    return app
