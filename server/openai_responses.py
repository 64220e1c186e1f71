"""Pydantic response models of the OpenAI-compatible API (the shapes OpenAI's clients parse)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

WEIGHT_VERSION = "default"


class UsageInfo(BaseModel):
    """OpenAI's usage object, exactly its fields (reasoning tokens go in completion_tokens_details)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: dict[str, int] | None = None
    completion_tokens_details: dict[str, int] = Field(default_factory=lambda: {"reasoning_tokens": 0})


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    matched_stop: int | str | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = Field(  # vLLM's extension, only when asked
        default=None, exclude_if=lambda v: v is None)


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    metadata: dict[str, str] | None = None


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


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    matched_stop: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = Field(  # vLLM's extension, only when asked
        default=None, exclude_if=lambda v: v is None)
    metadata: dict[str, str] = Field(default_factory=lambda: {"weight_version": WEIGHT_VERSION})


class ChatStreamChoice(BaseModel):
    index: int
    delta: dict[str, str]  # {"role", "content"} first, then {"content"}, and {} in the final frame
    logprobs: ChoiceLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    matched_stop: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None
