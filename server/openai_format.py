"""OpenAI requests <-> engine: the response models (the shapes OpenAI's clients parse), the chat prompt; finish
fields and both logprob formats as pure functions over deltas and joined outputs (bodies and chunks alike)."""

import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from engine.runtime.request import Logprobs
from engine.runtime.tokenizer import ChatTemplateError, Tokenizer
from server.errors import ApiError, BadRequest
from server.openai_protocol import ChatCompletionRequest

_RESERVED_TEMPLATE_KEYS = ("messages", "add_generation_prompt")
WEIGHT_VERSION = "default"


class UsageInfo(BaseModel):
    """OpenAI's usage object; prompt_tokens_details (cached tokens) null unless --enable-cache-report (SGLang, vLLM)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class _Choice(BaseModel):
    index: int
    finish_reason: Literal["stop", "length", "abort"] | None = None
    matched_stop: int | str | None = None


class CompletionChoice(_Choice):
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's extension (null unless asked)


class _Response(BaseModel):
    id: str
    object: str
    created: int
    model: str


class CompletionResponse(_Response):
    object: str = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    metadata: dict[str, str] = Field(default_factory=lambda: {"weight_version": WEIGHT_VERSION})  # (not in frames)


class TopLogprob(BaseModel):
    token: str
    bytes: list[int]
    logprob: float | None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(_Choice):
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionResponse(_Response):
    object: str = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's extension (null unless asked)
    metadata: dict[str, str] = Field(default_factory=lambda: {"weight_version": WEIGHT_VERSION})


class ChatStreamChoice(_Choice):
    delta: dict[str, str]  # {"role", "content"} first, then {"content"}, and {} in the final frame
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Response):
    object: str = "chat.completion.chunk"
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


def finish_fields(reason: dict[str, Any] | None) -> dict[str, Any]:
    """finish_reason and matched_stop: "stop" with the matched id or string, "length"/"abort" with null."""
    kind = None if reason is None else reason.get("type")
    return {"finish_reason": kind, "matched_stop": reason.get("matched") if kind == "stop" else None}


def token_text(tok: Tokenizer, token_id: int) -> str:
    return tok.decode([token_id], skip_special_tokens=False)


def completion_logprobs(tok: Tokenizer, lp: Logprobs, echo: bool, offset: int) -> tuple[CompletionLogprobs, int]:
    """/v1/completions `logprobs` for one delta's entries (the prompt's first when echoing; the first
    prompt entry has no logprob). With `logprobs: 0` each position's top_logprobs holds the token itself.
    Returns the object and the text offset after it (offsets count into the choice's returned text)."""
    out = CompletionLogprobs()
    rows = list(zip(lp.input_token, lp.input_top or [None] * len(lp.input_token))) if echo else []
    rows += list(zip(lp.output_token, lp.output_top or [None] * len(lp.output_token)))
    for (logprob, token_id), top in rows:
        out.tokens.append(text := token_text(tok, token_id))
        out.token_logprobs.append(logprob)
        out.text_offset.append(offset)
        offset += len(text)
        alts = top if top else ([(logprob, token_id)] if logprob is not None else [])
        out.top_logprobs.append({token_text(tok, t): v for v, t in alts} or None)
    return out, offset


def _top(tok: Tokenizer, logprob: float | None, token_id: int) -> TopLogprob:
    text = token_text(tok, token_id)
    return TopLogprob(token=text, bytes=list(text.encode("utf-8")), logprob=logprob)


def chat_logprobs(tok: Tokenizer, lp: Logprobs) -> list[TokenLogprob]:
    """/v1/chat/completions `logprobs.content` entries for one delta's output tokens."""
    return [TokenLogprob(**_top(tok, v, t).model_dump(), top_logprobs=[_top(tok, a, b) for a, b in top or ()])
            for (v, t), top in zip(lp.output_token, lp.output_top or [[] for _ in lp.output_token])]


def prompt_logprobs(tok: Tokenizer, lp: Logprobs | None, k: int | None) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs` (None unless asked): per prompt position None (the first) or {token id: {logprob,
    rank, decoded_token}} for the prompt token and `k` alternatives."""
    if k is None or lp is None:
        return None
    out: list[dict[str, dict[str, Any]] | None] = []
    for (v, t), top, rank in zip(lp.input_token, lp.input_top or [None] * len(lp.input_token), lp.input_rank):
        if v is None:
            out.append(None)
            continue
        entry = {str(t): {"logprob": v, "rank": rank, "decoded_token": token_text(tok, t)}}
        for r, (a, b) in enumerate((top or [])[:k], start=1):
            entry.setdefault(str(b), {"logprob": a, "rank": r, "decoded_token": token_text(tok, b)})
        out.append(entry)
    return out


def chat_prompt_ids(tok: Tokenizer, req: ChatCompletionRequest) -> list[int]:
    """Render the messages with the chat template and tokenize (the template holds any BOS). continue_final_message
    keeps the last (assistant) message open: the prompt is cut where a sentinel renders in its place."""
    messages = [m.model_dump() for m in req.messages]
    kwargs = {k: v for k, v in (req.chat_template_kwargs or {}).items() if k not in _RESERVED_TEMPLATE_KEYS}
    def render(msgs: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        try:
            return tok.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, **kwargs)
        except ChatTemplateError as e:  # the template's raise_exception: the messages' fault
            raise BadRequest(str(e)) from None

    if not req.continue_final_message:
        return tok.encode(render(messages, True), add_special_tokens=False)
    if messages[-1]["role"] != "assistant":
        raise ApiError(400, "continue_final_message needs the last message to have role 'assistant'.")
    sentinel = f"<<continue-{uuid.uuid4().hex}>>"
    rendered = render([*messages[:-1], {**messages[-1], "content": sentinel}], False)
    if (cut := rendered.find(sentinel)) < 0:
        raise ApiError(400, "the chat template drops the final message's content; cannot continue it.")
    if isinstance(content := messages[-1]["content"], list):
        content = "".join(str(part.get("text", "")) for part in content if part.get("type") == "text")
    return tok.encode(rendered[:cut] + (content or ""), add_special_tokens=False)
