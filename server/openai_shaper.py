"""What the two OpenAI generation routes send for a submission: stream frames (`frame`, `tail`), the whole response
(`response`), as NativeShaper does for /generate. The route parses, checks, submits; `respond` streams or collects."""

import time
from collections.abc import Iterable, Iterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from engine.runtime.tokenizer import Tokenizer
from server import openai_format as fmt
from server.openai_protocol import ChatCompletionRequest, CompletionRequest
from server.submission import Submission, respond


def _sse(model: BaseModel, drop: Any = None) -> str:
    return f"data: {model.model_dump_json(exclude=drop)}\n\n"


class _Shaper:
    chunk_type: type[BaseModel]  # the stream's frame (its usage-only tail too)

    def __init__(self, sub: Submission, req: Any, tok: Tokenizer, prompts: list[list[int]], cache_report: bool) -> None:
        self.sub, self.req, self.tok, self.cache_report = sub, req, tok, cache_report
        self.prompt_tokens, self.n = sum(len(p) for p in prompts), req.n or 1
        self.head = {"id": sub.id, "created": int(time.time()), "model": req.model}

    def usage(self) -> fmt.UsageInfo:
        """Each prompt counted once (not once per sample); every sample's generated tokens counted."""
        prompt, joined = self.prompt_tokens, self.sub.joined
        completion = sum(len(j.output_ids) for j in joined)
        cached = sum(j.last.cached_tokens for j in joined[::self.n] if j.last is not None)
        return fmt.UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                             prompt_tokens_details={"cached_tokens": cached} if self.cache_report else None)

    def head_frames(self) -> Iterable[str]:
        return ()

    def chunk(self, choice: Any, drop: dict[str, Any] | None = None) -> str:
        usage = self.usage() if self.req.continuous_usage else None
        drop = (drop or {}) | {"metadata": True} | ({} if usage else {"usage": True})
        return _sse(self.chunk_type(**self.head, choices=[choice], usage=usage), drop)

    def tail(self) -> Iterator[str]:
        if self.req.include_usage:
            yield _sse(self.chunk_type(**self.head, choices=[], usage=self.usage()), {"metadata"})

    async def respond(self, request: Request) -> Response:
        return await respond(self.sub, request, bool(self.req.stream), self.frame, self.response,
                             self.head_frames(), self.tail())


class CompletionShaper(_Shaper):
    chunk_type = fmt.CompletionResponse

    def __init__(self, sub: Submission, req: CompletionRequest, tok: Tokenizer, prompts: list[list[int]],
                 given: list[Any], cache_report: bool) -> None:
        super().__init__(sub, req, tok, prompts, cache_report)
        self.echo, self.started = bool(req.echo), [False] * len(sub.rids)
        self.texts = [p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False) for p in given]
        self.offsets = [0] * len(sub.rids)  # text_offset of each sequence's next token

    def choice(self, i: int, text: str, lp: Any, reason: Any, joined: Any) -> fmt.CompletionChoice:
        lps = None
        if self.req.logprobs is not None and lp is not None:
            lps, self.offsets[i] = fmt.completion_logprobs(self.tok, lp, self.echo, self.offsets[i])
        plp = fmt.prompt_logprobs(self.tok, joined.logprobs, self.req.prompt_logprobs) if reason is not None else None
        return fmt.CompletionChoice(index=i, text=text, logprobs=lps, prompt_logprobs=plp, **fmt.finish_fields(reason))

    def frame(self, i: int, out: Any) -> str | None:
        text = (self.texts[i // self.n] if self.echo and not self.started[i] else "") + out.new_text
        self.started[i] = True
        c = self.choice(i, text, out.logprobs, out.finish_reason if out.finished else None, self.sub.joined[i])
        if not (text or out.finished or (c.logprobs and c.logprobs.tokens)):
            return None
        # vLLM's prompt_logprobs key, in a stream only where asked
        return self.chunk(c, {"choices": {0: {"prompt_logprobs"}}} if c.prompt_logprobs is None else None)

    def response(self, joined: list) -> dict[str, Any]:
        choices = [self.choice(i, (self.texts[i // self.n] if self.echo else "") + j.text, j.logprobs,
                               j.last.finish_reason, j) for i, j in enumerate(joined)]
        return fmt.CompletionResponse(**self.head, choices=choices, usage=self.usage()).model_dump(mode="json")


class ChatShaper(_Shaper):
    chunk_type = fmt.ChatCompletionChunk
    req: ChatCompletionRequest

    def head_frames(self) -> Iterator[str]:
        for i in range(len(self.sub.rids)):
            yield self.chunk(fmt.ChatStreamChoice(index=i, delta={"role": "assistant", "content": ""}))

    def frame(self, i: int, out: Any) -> str | None:
        """The new content, then the finish in a chunk of its own (SGLang's and OpenAI's shape). With vLLM's
        continuous_usage_stats the last content chunk carries the finish, so every chunk's count rises."""
        lines, one = [], self.req.continuous_usage
        entries = fmt.chat_logprobs(self.tok, out.logprobs) if self.req.logprobs and out.logprobs else []
        ends = fmt.finish_fields(out.finish_reason if out.finished else None)
        if out.new_text or entries or (one and out.finished):
            lp = fmt.ChoiceLogprobs(content=entries) if self.req.logprobs else None
            lines.append(self.chunk(fmt.ChatStreamChoice(index=i, delta={"content": out.new_text}, logprobs=lp,
                                                         **(ends if one else {}))))
        if out.finished and not one:
            lines.append(self.chunk(fmt.ChatStreamChoice(index=i, delta={}, **ends)))
        return "".join(lines) or None

    def response(self, joined: list) -> dict[str, Any]:
        lps = [fmt.ChoiceLogprobs(content=fmt.chat_logprobs(self.tok, j.logprobs))
               if self.req.logprobs and j.logprobs else None for j in joined]
        choices = [fmt.ChatChoice(index=i, message=fmt.AssistantMessage(content=j.text), logprobs=lps[i],
                                  **fmt.finish_fields(j.last.finish_reason)) for i, j in enumerate(joined)]
        plp = fmt.prompt_logprobs(self.tok, joined[0].logprobs, self.req.prompt_logprobs)
        resp = fmt.ChatCompletionResponse(**self.head, choices=choices, usage=self.usage(), prompt_logprobs=plp)
        return resp.model_dump(mode="json")
