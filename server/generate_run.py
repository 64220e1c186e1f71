"""One /generate call in flight: submit its sequences, collect or stream their outputs, abort leftovers.

Whatever way the call ends (finished, client gone, server error, shutdown), `close()` aborts every
sequence that has not finished, so its KV slots are freed at once. `SSEResponse` guarantees `close()`
runs for streams; the non-stream path races the results against the client's disconnect.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import suppress
from typing import Any

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.request import RequestOutput
from server.errors import ApiError
from server.generate_inputs import GenPlan
from server.native_output import OutputShaper, server_error
from server.state import ServerState

logger = logging.getLogger("server.access")


class ClientGone(Exception):
    """The HTTP client disconnected before the result was ready."""


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always runs `on_close` (client gone, error, or done)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                aclose = getattr(self.body_iterator, "aclose", None)
                if aclose is not None:
                    await aclose()
            self.on_close()


def sse(data: Any) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False)}\n\n"


class GenerationRun:
    def __init__(self, state: ServerState, plan: GenPlan, started: float) -> None:
        self.state, self.plan, self.started = state, plan, started
        self.rids: list[str] = []  # expanded: prompt i, sample j -> index i * n + j
        self.shapers: list[OutputShaper] = []
        self.iters: list[AsyncIterator[RequestOutput]] = []
        self.unfinished: set[str] = set()

    def submit(self) -> None:
        """Queue every sequence; if one is refused, abort those already queued and re-raise."""
        eng, args = self.state.async_engine, self.state.args
        try:
            for item in self.plan.items:
                for rid in eng.submit(item.prompt_ids, item.params, item.logprob, item.rid):
                    self.rids.append(rid)
                    self.unfinished.add(rid)
                    self.iters.append(eng.stream(rid))
                    self.shapers.append(OutputShaper(
                        rid, item.logprob, self.state.tokenizer, self.plan.return_text_in_logprobs,
                        args.incremental_streaming_output, self.started, item.params.stream_interval))
        except Exception:
            self.close()
            raise

    def close(self) -> None:
        """Abort whatever has not finished (idempotent)."""
        for rid in list(self.unfinished):
            self.state.async_engine.abort(rid)
            self._log(rid, None, 499)
        self.unfinished.clear()

    def _finished(self, idx: int, out: RequestOutput, status: int) -> None:
        if out.rid in self.unfinished:
            self.unfinished.discard(out.rid)
            self._log(out.rid, out, status)

    def _log(self, rid: str, out: RequestOutput | None, status: int) -> None:
        fr = (out.finish_reason or {}).get("type") if out is not None else "client_gone"
        logger.info("rid=%s prompt_tokens=%s completion_tokens=%s latency=%.3fs status=%d finish=%s", rid,
                    out.prompt_tokens if out else "-", len(out.output_ids) if out else "-",
                    time.monotonic() - self.started, status, fr)

    # ---- non-stream --------------------------------------------------------------------------------
    async def results(self, request: Request) -> list[dict[str, Any]]:
        """Every sequence's final body in expanded order; ClientGone if the client leaves first."""

        async def last(it: AsyncIterator[RequestOutput]) -> RequestOutput:
            final = None
            async for out in it:
                final = out
            assert final is not None
            return final

        gathered = asyncio.ensure_future(asyncio.gather(*(last(it) for it in self.iters)))
        watcher = asyncio.ensure_future(_wait_disconnect(request))
        done: set[asyncio.Future[Any]] = set()
        try:
            done, _ = await asyncio.wait({gathered, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not gathered.done():
                gathered.cancel()  # the iterators abort their requests
                with suppress(asyncio.CancelledError, Exception):
                    await gathered
        if gathered not in done:
            self.close()
            raise ClientGone()
        outs: list[RequestOutput] = gathered.result()
        errors = [e for e in (server_error(o) for o in outs) if e is not None]
        for i, out in enumerate(outs):
            self._finished(i, out, errors[0][0] if errors else 200)
        if errors:
            raise ApiError(*errors[0])
        return [self.shapers[i].full(out) for i, out in enumerate(outs)]

    # ---- stream ------------------------------------------------------------------------------------
    async def events(self) -> AsyncIterator[str]:
        """SSE frames of all sequences, interleaved as they come, then `data: [DONE]`."""
        # NOTE: bounded, so a client that stops reading stalls the pumps and the backlog stays in
        # AsyncEngine's per-request Outbox, which merges cumulative outputs past its limit.
        merged: asyncio.Queue[tuple[int, RequestOutput | BaseException]] = asyncio.Queue(maxsize=8)

        async def pump(idx: int, it: AsyncIterator[RequestOutput]) -> None:
            try:
                async for out in it:
                    await merged.put((idx, out))
            except Exception as e:  # surfaced to the client as an error frame
                await merged.put((idx, e))

        tasks = [asyncio.ensure_future(pump(i, it)) for i, it in enumerate(self.iters)]
        multi = not self.plan.single
        try:
            left = len(tasks)
            while left:
                idx, out = await merged.get()
                if isinstance(out, BaseException):
                    logger.exception("stream of %s failed", self.rids[idx], exc_info=out)
                    yield sse({"error": {"message": f"internal error: {type(out).__name__}"}})
                    break
                err = server_error(out)
                if err is not None:
                    self._finished(idx, out, err[0])
                    yield sse({"error": {"message": err[1], "code": err[0]}})
                    break
                frame = self.shapers[idx].frame(out)
                if out.finished:
                    left -= 1
                    self._finished(idx, out, 200)
                if frame is not None:
                    if multi:
                        frame["index"] = idx
                    yield sse(frame)
                    # NOTE: a real suspension per frame. Once the client is gone uvicorn's send returns at
                    # once and a backlog is read without suspending, so without it the disconnect (a
                    # cancellation) would wait until the whole backlog had been shaped and serialized.
                    await asyncio.sleep(0)
            yield "data: [DONE]\n\n"
        finally:
            for t in tasks:
                t.cancel()
            self.close()


async def _wait_disconnect(request: Request) -> None:
    """Return once the client has disconnected (the body was read already, so only that can arrive)."""
    while True:
        message = await request.receive()
        if message.get("type") == "http.disconnect":
            return
