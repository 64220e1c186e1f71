"""OpenAI requests ↔ engine: chat prompt rendering; finish fields, usage and both logprob formats.

Pure functions and small cursors, no HTTP: the routes (non-stream) and openai_stream (SSE) share them.
"""

from __future__ import annotations

import uuid
from typing import Any

from engine.request import Logprobs, RequestOutput
from engine.tokenizer import Tokenizer
from server.errors import ApiError
from server.openai_protocol import (
    ChatCompletionRequest,
    CompletionLogprobs,
    TokenLogprob,
    TopLogprob,
    UsageInfo,
)

Entry = tuple[float | None, int]
_RESERVED_TEMPLATE_KEYS = ("messages", "add_generation_prompt")


def finish_fields(reason: dict[str, Any] | None) -> tuple[str | None, int | str | None]:
    """(finish_reason, matched_stop): "stop" with the matched id or string, "length"/"abort" with null."""
    if reason is None:
        return None, None
    kind = reason.get("type")
    return kind, reason.get("matched") if kind == "stop" else None


def raise_if_failed(out: RequestOutput) -> None:
    """A server-side abort (status_code set, e.g. an engine failure) becomes that HTTP error."""
    reason = out.finish_reason or {}
    if reason.get("type") == "abort" and reason.get("status_code"):
        raise ApiError(int(reason["status_code"]), str(reason.get("message") or out.error or "request aborted"))


def usage_of(prompt_lens: list[int], outputs: list[RequestOutput | None]) -> UsageInfo:
    """Each prompt counted once (not once per sample); every sample's generated tokens counted."""
    prompt = sum(prompt_lens)
    completion = sum(len(o.output_ids) for o in outputs if o is not None)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def token_text(tok: Tokenizer, token_id: int) -> str:
    """The text of one token as logprobs show it (special tokens kept)."""
    return tok.decode([token_id], skip_special_tokens=False)


class CompletionLogprobCursor:
    """Builds /v1/completions `logprobs` for one choice, incrementally (stream) or all at once.

    With echo the prompt's entries come first (the first one has a null logprob and no alternatives).
    `text_offset` counts characters into this choice's returned text (all stream deltas joined).
    """

    def __init__(self, tok: Tokenizer, echo: bool) -> None:
        self.tok = tok
        self.input_pending = echo
        self.n_out = 0
        self.offset = 0

    def take(self, lp: Logprobs | None) -> CompletionLogprobs:
        """Entries not returned yet (prompt entries once, then each new output token)."""
        out = CompletionLogprobs()
        if lp is None:
            return out
        rows: list[tuple[Entry, list[tuple[float, int]] | None]] = []
        if self.input_pending:
            self.input_pending = False
            tops = lp.input_top or [None] * len(lp.input_token)
            rows += list(zip(lp.input_token, tops))
        new = lp.output_token[self.n_out:]
        tops_out = lp.output_top[self.n_out:] if lp.output_top else [None] * len(new)
        rows += list(zip(new, tops_out))
        self.n_out += len(new)
        for (logprob, token_id), top in rows:
            text = token_text(self.tok, token_id)
            out.tokens.append(text)
            out.token_logprobs.append(logprob)
            out.text_offset.append(self.offset)
            self.offset += len(text)
            out.top_logprobs.append(None if not top else {token_text(self.tok, t): v for v, t in top})
        return out


def _top(tok: Tokenizer, logprob: float | None, token_id: int) -> TopLogprob:
    text = token_text(tok, token_id)
    return TopLogprob(token=text, bytes=list(text.encode("utf-8")), logprob=logprob)


class ChatLogprobCursor:
    """Builds /v1/chat/completions `logprobs.content` entries for one choice, new tokens per call."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok = tok
        self.n_out = 0

    def take(self, lp: Logprobs | None) -> list[TokenLogprob]:
        if lp is None:
            return []
        new = lp.output_token[self.n_out:]
        tops = lp.output_top[self.n_out:] if lp.output_top else [[] for _ in new]
        self.n_out += len(new)
        entries = []
        for (logprob, token_id), top in zip(new, tops):
            head = _top(self.tok, logprob, token_id)
            alts = [_top(self.tok, v, t) for v, t in top or ()]
            entries.append(TokenLogprob(**head.model_dump(), top_logprobs=alts))
        return entries


def _content_text(content: str | list[dict[str, Any]] | None) -> str:
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if part.get("type") == "text")
    return content or ""


def chat_prompt_ids(tok: Tokenizer, req: ChatCompletionRequest) -> list[int]:
    """Render the messages with the chat template and tokenize (the template already holds any BOS).

    With continue_final_message the last (assistant) message is left open: the template renders a
    sentinel in its place and the prompt is cut there, so the model continues the message's text.
    """
    messages = [m.model_dump() for m in req.messages]
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KEYS}
    if not req.continue_final_message:
        return tok.encode(tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs),
                          add_special_tokens=False)
    if messages[-1]["role"] != "assistant":
        raise ApiError(400, "continue_final_message needs the last message to have role 'assistant'.")
    sentinel = f"<<continue-{uuid.uuid4().hex}>>"
    rendered = tok.apply_chat_template([*messages[:-1], {**messages[-1], "content": sentinel}],
                                       add_generation_prompt=False, **kwargs)
    cut = rendered.find(sentinel)
    if cut < 0:
        raise ApiError(400, "the chat template drops the final message's content; cannot continue it.")
    text = rendered[:cut] + _content_text(messages[-1]["content"])
    return tok.encode(text, add_special_tokens=False)
