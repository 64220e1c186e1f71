"""One HTTP request's sequences in the engine, from submit (all or nothing) to the last output (every generation route).
However it ends (done, client gone, error, shutdown), the unfinished are aborted (streams: by `SSEResponse`)."""

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterable
from contextlib import suppress
from functools import partial
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.runtime.request import JoinedOutput, NewRequest, RequestOutput
from engine.runtime.sampling_params import SamplingParams
from server.async_engine import AsyncEngine
from server.errors import ApiError, BadRequest, sse_error

logger = logging.getLogger("server.access")
CLIENT_CLOSED = 499  # nginx's "client closed request": logged, never seen by anyone


class ClientGone(Exception):
    """The HTTP client disconnected before the result was ready."""


def sampling_params(raw: dict[str, Any], cap: int | None, default: int | None) -> SamplingParams:
    """A request's SamplingParams (a bad value: the client's 400), and the one place --max-new-tokens-cap meets
    max_new_tokens: left out, it is the route's `default` lowered to the cap; given, the engine checks it."""
    try:
        return SamplingParams.from_dict({"max_new_tokens": default if cap is None else min(default or cap, cap)} | raw)
    except ValueError as e:
        raise BadRequest(str(e)) from None


class Submission:
    def __init__(self, ae: AsyncEngine, reqs: list[NewRequest], route: str, started: float | None = None,
                 response_id: str = "") -> None:
        self.ae, self.route, self.id = ae, route, response_id  # (the response id, where the route has one)
        self.started = time.monotonic() if started is None else started
        self.rids, self._channel = ae.submit(reqs)  # BadRequest -> 400, EngineDeadError -> 503
        self.joined, self._open = [JoinedOutput(r) for r in self.rids], set(range(len(self.rids)))

    async def outputs(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(sequence index, new delta) until all finish (`joined[i]` holds the delta); a failed one raises ApiError."""
        while self._open:
            i, out = await self._channel.get()
            self.joined[i].add(out)
            if out.finished:
                fr = out.finish_reason or {}  # a server-side abort carries the HTTP status it means
                failed = fr.get("type") == "abort" and fr.get("status_code") is not None
                self._done(i, int(fr["status_code"]) if failed else 200)
                if failed:  # its access-log line is written: the error handler adds none
                    message = fr.get("message") or out.error or "request aborted by the server"
                    raise ApiError(int(fr["status_code"]), str(message), logged=True)
            yield i, out

    async def collect(self, request: Request) -> list[JoinedOutput]:
        """Every sequence's joined result; ClientGone (after aborting them) if the client leaves first."""
        self._channel.quiet = True  # (no reader per step: the deltas wait in the channel for a finish)

        async def drain() -> None:
            async for _ in self.outputs():
                pass

        async def wait_disconnect() -> None:  # the body was read already, so only that can arrive
            while (await request.receive()).get("type") != "http.disconnect":
                pass

        results, gone = asyncio.ensure_future(drain()), asyncio.ensure_future(wait_disconnect())
        try:
            await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not results.done():
                raise ClientGone()
            results.result()  # a failed sequence: its ApiError
            return self.joined
        finally:
            for task in (results, gone):
                task.cancel()
                with suppress(asyncio.CancelledError, Exception):
                    await task
            self.close()

    def close(self) -> None:
        """Abort every sequence that has not finished (idempotent), logged in SGLang's words."""
        for i in sorted(self._open):
            logger.info("Request is disconnected from the client side. Abort request rid=%s", self.rids[i])
            self.ae.abort(self.rids[i])
            self._done(i, CLIENT_CLOSED)

    def _done(self, i: int, status: int) -> None:
        if i in self._open:
            self._open.discard(i)
            res = self.joined[i]
            reason = (res.finish_reason or {}).get("type") if res.finished else "client_gone"
            log_access(res.rid, res.last.prompt_tokens if res.last else "-", len(res.output_ids),
                       time.monotonic() - self.started, status, reason, self.route)


def log_access(rid: str, prompt_tokens: int | str, completion_tokens: int, latency: float, status: int,
               finish: str | None, route: str) -> None:
    """The one access-log line of a request (every route; refused requests too, from server.app)."""
    logger.info("rid=%s prompt_tokens=%s completion_tokens=%d latency=%.3fs status=%d finish=%s route=%s",
                rid, prompt_tokens, completion_tokens, latency, status, finish, route)


async def respond(sub: Submission, request: Request, stream: bool, frame: Any, whole: Any,
                  head: Iterable[str] = (), tail: Iterable[str] = ()) -> Response:
    """A generation route's response: the stream of `sse_frames`, or whole(joined results) as JSON once
    every sequence has finished (a client gone first: 499, logged only)."""
    if stream:
        return SSEResponse(sse_frames(sub, frame, partial(sse_error, sub.route), head, tail), sub)
    try:
        joined = await sub.collect(request)
    except ClientGone:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(whole(joined))


class SSEResponse(StreamingResponse):
    """text/event-stream of `frames`; afterwards (done, client gone, error) the frames' generator is
    closed and the submission's unfinished sequences aborted, even if no frame was ever produced."""

    def __init__(self, frames: AsyncGenerator[str, None], submission: Submission) -> None:
        super().__init__(frames, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.frames, self.submission = frames, submission

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.frames.aclose()
            self.submission.close()


async def sse_frames(sub: Submission, frame: Any, error: Any, head: Iterable[str] = (),
                     tail: Iterable[str] = ()) -> AsyncIterator[str]:
    """`data:` lines: `head`, frame(i, out) per output (None: skip), `tail`, then [DONE] (`head`, `tail` may be
    generators, run when reached). An error once streaming began becomes error(status, message), ending the stream."""
    try:
        for text in head:
            yield text
        async for i, out in sub.outputs():
            if (text := frame(i, out)) is not None:
                yield text
                # NOTE: suspend per frame, else a gone client's backlog is sent unsuspended, its cancellation waiting.
                await asyncio.sleep(0)
        for text in tail:
            yield text
    except ApiError as e:
        yield error(e.status, e.message)
    except Exception as e:  # noqa: BLE001 - the status line is already sent
        logger.exception("error while streaming")
        yield error(500, f"internal error: {type(e).__name__}")
    yield "data: [DONE]\n\n"
