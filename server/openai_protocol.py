"""Pydantic request models of /v1/completions and /v1/chat/completions (http_api.md §3; the responses are in
server/openai_format.py): unknown keys ignored (like OpenAI and SGLang), wrong types a 400 (routes_openai)."""

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class SamplingFields(BaseModel):
    """The request fields shared by completions and chat (OpenAI names plus SGLang's extras)."""

    model: str = "default"
    n: int | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = Field(default=None, ge=-(2**63), le=2**63 - 1)  # int64, as vLLM (its errors name the bound)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    no_stop_trim: bool | None = None
    regex: str | None = None
    json_schema: str | None = None
    ebnf: str | None = None
    rid: str | None = None
    prompt_logprobs: int | None = None  # vLLM's extension: logprobs of the prompt tokens (-1: the whole vocabulary)
    best_of: int | None = None
    use_beam_search: bool | None = None

    @field_validator("max_tokens", "max_completion_tokens", check_fields=False)
    @classmethod
    def _max_tokens(cls, v: int | None, info: Any) -> int | None:
        if v is not None and v <= 0:
            raise ValueError(f"{info.field_name} must be positive, got {v}")
        return v

    @model_validator(mode="after")
    def _stream_options(self) -> "SamplingFields":
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def unsupported(self) -> str | None:
        for name in ("regex", "json_schema", "ebnf"):
            if getattr(self, name) is not None:
                return f"{name} (constrained decoding) is not supported by this server."
        if self.best_of is not None and self.best_of > 1:
            return f"best_of={self.best_of} is not supported by this server (only 1); use n for several samples."
        if self.use_beam_search:
            return "use_beam_search is not supported by this server (no beam search); remove it."
        return None

    def sampling_dict(self) -> dict[str, Any]:
        """SamplingParams keys but max_new_tokens (`SamplingParams.from_dict` treats None as "use the default")."""
        same = ("n", "temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                "repetition_penalty", "stop", "stop_token_ids", "logit_bias", "ignore_eos", "skip_special_tokens",
                "no_stop_trim")  # (the other two are named differently there)
        return {"min_new_tokens": self.min_tokens, "sampling_seed": self.seed} | {k: getattr(self, k) for k in same}

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool | None = False
    suffix: str | None = None

    def unsupported(self) -> str | None:
        return "suffix (insertion) is not supported by this server." if self.suffix else super().unsupported()


class ChatMessage(BaseModel):
    """One message; extra keys (name, tool_call_id, ...) pass through to the chat template."""

    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0)
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None

    def unsupported(self) -> str | None:
        if self.tools:
            return "tools (function calling) are not supported by this server."
        if self.response_format and self.response_format.get("type", "text") != "text":
            return f"response_format {self.response_format.get('type')!r} is not supported by this server."
        return super().unsupported()


def document_request_bodies(schema: dict[str, Any]) -> None:
    """Add the JSON request bodies of the two generation routes to an OpenAPI document: both parse their body
    themselves (Content-Type check, OpenAI error envelope), so FastAPI cannot see the models."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)):
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update({name: sub for name, sub in body.pop("$defs", {}).items() if name not in components})
        components[model.__name__] = body
        schema["paths"][path]["post"]["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    for path, item in schema["paths"].items():  # validation errors: 400 in this server's envelopes (app.py), not 422
        for op in item.values():
            op.setdefault("responses", {}).pop("422", None)
            op["responses"]["400"] = {"description": "Bad request: " + (
                "the OpenAI error object" if path.startswith("/v1/") else '{"error": {"message": ...}}')}
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
