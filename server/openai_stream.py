"""Server-sent events for /v1/completions and /v1/chat/completions (http_api.md §3.1, §3.2).

Requests are submitted (and validated) before a stream starts, so these generators only format
outputs. Closing a generator (client gone) cancels the per-sample readers, and AsyncEngine.stream
aborts every unfinished sample.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import anyio
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Send

from engine.request import RequestOutput
from engine.tokenizer import Tokenizer
from server.async_engine import AsyncEngine
from server.errors import OPENAI_TYPES, ApiError
from server.openai_convert import (
    ChatLogprobCursor,
    CompletionLogprobCursor,
    finish_fields,
    raise_if_failed,
    usage_of,
)
from server.openai_protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatStreamChoice,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
)

logger = logging.getLogger(__name__)
DONE = "data: [DONE]\n\n"


@dataclass
class Job:
    """One submitted OpenAI request: a rid per choice (prompt-major: choice i samples prompt i // n).

    NOTE: `streams` are opened right after submit, on the same event-loop turn: a short request can
    finish (and leave AsyncEngine's table) before a consumer that opened them later would start.
    """

    ae: AsyncEngine
    id: str
    created: int
    model: str
    rids: list[str]
    n: int
    prompt_lens: list[int]
    streams: list[AsyncIterator[RequestOutput]]
    prompt_texts: list[str] = field(default_factory=list)  # filled only when echo needs them
    finished: set[int] = field(default_factory=set)  # choices whose final output was read

    def abort_unfinished(self) -> None:
        """Abort every sample whose final output was not read, including samples never read at all."""
        for i, rid in enumerate(self.rids):
            if i not in self.finished:
                self.ae.abort(rid)
        self.finished.update(range(len(self.rids)))


class EventStreamResponse(StreamingResponse):
    """text/event-stream that always closes its generator and then calls `on_close`, even when the
    client vanished before the first frame (a generator that never started runs no `finally`)."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncGenerator[str, None], on_close: Callable[[], None]) -> None:
        super().__init__(content)
        self.on_close = on_close

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()  # type: ignore[attr-defined]
            self.on_close()


def sse(obj: BaseModel, drop: set[str] | None = None) -> str:
    return f"data: {obj.model_dump_json(exclude=drop)}\n\n"


def error_event(status: int, message: str) -> str:
    body = {"message": message, "type": OPENAI_TYPES.get(status, str(status)), "param": None, "code": status}
    return f"data: {json.dumps({'error': body}, ensure_ascii=False)}\n\n"


async def merge_streams(job: Job) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from all samples as they arrive; closing it aborts the unfinished ones."""
    # NOTE: bounded, so a reader that stops leaves the backlog in AsyncEngine's merging Outbox.
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue(maxsize=8)

    async def pump(i: int, outputs: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in outputs:
                await queue.put((i, out))
            await queue.put((i, None))
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(job.streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                left -= 1
                continue
            if item.finished:
                job.finished.add(i)
            yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        job.abort_unfinished()


async def collect(job: Job) -> list[RequestOutput]:
    """The final output of every choice (non-streaming responses)."""
    finals: list[RequestOutput | None] = [None] * len(job.rids)
    async with aclosing(merge_streams(job)) as outs:
        async for i, out in outs:
            if out.finished:
                finals[i] = out
    assert all(o is not None for o in finals)
    return finals  # type: ignore[return-value]


async def _guarded(frames: AsyncGenerator[str, None]) -> AsyncGenerator[str, None]:
    """Pass frames through; an error once streaming has begun becomes an error event. Ends with [DONE]."""
    try:
        async for frame in frames:
            yield frame
            await asyncio.sleep(0)  # a suspension per frame: a client's disconnect is seen mid-backlog
    except ApiError as e:
        yield error_event(e.status, e.message)
    except ValueError as e:
        yield error_event(400, str(e))
    except Exception as e:  # noqa: BLE001 - the status line is already sent
        logger.exception("error while streaming")
        yield error_event(500, f"internal server error: {type(e).__name__}")
    finally:
        await frames.aclose()
    yield DONE


def completion_stream(tok: Tokenizer, job: Job, req: CompletionRequest) -> EventStreamResponse:
    return EventStreamResponse(_guarded(_completion_frames(tok, job, req)), on_close=job.abort_unfinished)


async def _completion_frames(tok: Tokenizer, job: Job, req: CompletionRequest) -> AsyncGenerator[str, None]:
    k = len(job.rids)
    sent, latest = [""] * k, [None] * k
    pending_echo = [bool(req.echo)] * k
    cursors = [CompletionLogprobCursor(tok, bool(req.echo)) for _ in range(k)] if req.logprobs is not None else None
    head: dict[str, Any] = {"id": job.id, "created": job.created, "model": job.model}
    async with aclosing(merge_streams(job)) as outs:
        async for i, out in outs:
            raise_if_failed(out)
            latest[i] = out
            delta, sent[i] = out.text[len(sent[i]):], out.text
            if pending_echo[i]:
                pending_echo[i], delta = False, job.prompt_texts[i // job.n] + delta
            lp = cursors[i].take(out.logprobs) if cursors else None
            if not (delta or out.finished or (lp and lp.tokens)):
                continue
            reason, matched = finish_fields(out.finish_reason)
            choice = CompletionChoice(index=i, text=delta, logprobs=lp, finish_reason=reason, matched_stop=matched)
            usage = usage_of(job.prompt_lens, latest) if req.continuous_usage else None
            yield sse(CompletionResponse(**head, choices=[choice], usage=usage),
                      {"metadata"} | (set() if usage else {"usage"}))
    if req.include_usage:
        yield sse(CompletionResponse(**head, choices=[], usage=usage_of(job.prompt_lens, latest)), {"metadata"})


def chat_stream(tok: Tokenizer, job: Job, req: ChatCompletionRequest) -> EventStreamResponse:
    return EventStreamResponse(_guarded(_chat_frames(tok, job, req)), on_close=job.abort_unfinished)


async def _chat_frames(tok: Tokenizer, job: Job, req: ChatCompletionRequest) -> AsyncGenerator[str, None]:
    k = len(job.rids)
    sent, latest = [""] * k, [None] * k
    cursors = [ChatLogprobCursor(tok) for _ in range(k)] if req.logprobs else None
    head: dict[str, Any] = {"id": job.id, "created": job.created, "model": job.model}

    def chunk(choice: ChatStreamChoice) -> str:
        usage = usage_of(job.prompt_lens, latest) if req.continuous_usage else None
        return sse(ChatCompletionChunk(**head, choices=[choice], usage=usage), None if usage else {"usage"})

    for i in range(k):
        yield chunk(ChatStreamChoice(index=i, delta={"role": "assistant", "content": ""}))
    async with aclosing(merge_streams(job)) as outs:
        async for i, out in outs:
            raise_if_failed(out)
            latest[i] = out
            delta, sent[i] = out.text[len(sent[i]):], out.text
            entries = cursors[i].take(out.logprobs) if cursors else []
            if delta or entries:
                lp = ChoiceLogprobs(content=entries) if cursors else None
                yield chunk(ChatStreamChoice(index=i, delta={"content": delta}, logprobs=lp))
            if out.finished:
                reason, matched = finish_fields(out.finish_reason)
                yield chunk(ChatStreamChoice(index=i, delta={}, finish_reason=reason, matched_stop=matched))
    if req.include_usage:
        yield sse(ChatCompletionChunk(**head, choices=[], usage=usage_of(job.prompt_lens, latest)))
