"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (http_api.md §3). Every request
is parsed, tokenized and submitted before a response starts, so bad input is a 400 even for `stream: true`."""

import uuid
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from engine.runtime.request import LogprobOptions, NewRequest
from engine.runtime.tokenizer import Tokenizer
from server.errors import ApiError, media_type, not_json_message
from server.openai_format import chat_prompt_ids
from server.openai_protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from server.openai_shaper import ChatShaper, CompletionShaper
from server.state import ServerState, server_state
from server.submission import Submission, sampling_params

router = APIRouter()
M = TypeVar("M", bound=BaseModel)
COMPLETION_MAX_LOGPROBS = 5  # the completions API's own maximum for `logprobs`
MODEL_ALIASES = ("default",)  # what a client that names no model sends (the request models' default)


def _model_card(state: ServerState) -> dict[str, Any]:
    name = state.args.model_name
    return {"id": name, "object": "model", "created": int(state.started), "owned_by": "sglang", "root": name,
            "parent": None, "max_model_len": state.engine.context_len}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(server_state(request))]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    if model_id == (state := server_state(request)).args.model_name:
        return JSONResponse(_model_card(state))
    return JSONResponse(status_code=404, content={"error": {"message": f"The model '{model_id}' does not exist",
        "type": "invalid_request_error", "param": "model", "code": "model_not_found"}})


async def _parse(request: Request, model: type[M]) -> M:
    """The JSON body as `model`; anything else (wrong Content-Type, bad JSON, bad types) is a 400."""
    if media_type(ctype := request.headers.get("content-type", "")) != "application/json":
        raise ApiError(400, not_json_message(ctype))
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        raise RequestValidationError(e.errors()) from None  # the app's 400, "Invalid request: <field>: ..."


def _check(state: ServerState, req: SamplingFields) -> Tokenizer:
    """The route-level rules (unsupported features, the model name, logprob limits); the tokenizer."""
    if (problem := req.unsupported()) is not None:
        raise ApiError(400, problem)
    if req.model != state.args.model_name and req.model not in MODEL_ALIASES:
        raise ApiError(404, f"The model '{req.model}' does not exist (this server serves '{state.args.model_name}').",
                       {"param": "model"})
    if (k := req.prompt_logprobs) is not None:  # vLLM's -1 is the whole vocabulary, checked like any other count
        req.prompt_logprobs = k = state.engine.cfg.vocab_size if k == -1 else k
        if not 0 <= k <= state.args.max_logprobs:
            raise ApiError(400, f"prompt_logprobs: Requested prompt logprobs of {k}, which is " + (
                "negative (give -1 or a count)" if k < 0 else f"greater than max allowed: {state.args.max_logprobs}"),
                {"param": "prompt_logprobs"})
    if state.engine.tokenizer is None:
        raise ApiError(400, "the OpenAI routes need a tokenizer; this server runs with --skip-tokenizer-init.")
    return state.engine.tokenizer


def _logprob(req: SamplingFields, top: int | None, echo: bool) -> LogprobOptions:
    """`top` alternatives per output token (None: no logprobs); prompt logprobs for echo or vLLM's prompt_logprobs."""
    if top is None and req.prompt_logprobs is None:
        return LogprobOptions()
    return LogprobOptions(True, 0 if echo or req.prompt_logprobs is not None else -1,
                          max(top or 0, req.prompt_logprobs or 0))


def _submit(state: ServerState, req: SamplingFields, prompts: list[list[int]], max_new: int | None, given: bool,
            logprob: LogprobOptions, route: str) -> Submission:
    """`max_new`: the request's max tokens; `given`: sent by the client (else a default, which yields to the cap)."""
    given_max = {"max_new_tokens": max_new} if given and max_new is not None else {}
    params = sampling_params(req.sampling_dict() | given_max, state.args.engine.max_new_tokens_cap, max_new)
    base = req.rid or uuid.uuid4().hex
    reqs = [NewRequest(ids, params, logprob, base if len(prompts) == 1 else f"{base}_{p}",
                       fit_context=True) for p, ids in enumerate(prompts)]
    return Submission(state.async_engine, reqs, route, response_id=base)


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state, req = server_state(request), await _parse(request, CompletionRequest)
    tok, cap = _check(state, req), min(COMPLETION_MAX_LOGPROBS, state.args.max_logprobs)
    if req.logprobs is not None and req.logprobs > cap:
        raise ApiError(400, f"logprobs must be at most {cap}, got {req.logprobs}.", {"param": "logprobs"})
    one = isinstance(req.prompt, str) or (req.prompt and isinstance(req.prompt[0], int))
    given: list[Any] = [req.prompt] if one else req.prompt  # the 4 shapes: a string or token ids, or a list of either
    if not given or any(len(p) == 0 for p in given):
        raise ApiError(400, "Prompt cannot be empty")
    prompts = [tok.encode(p) if isinstance(p, str) else list(p) for p in given]
    sub = _submit(state, req, prompts, req.max_tokens, "max_tokens" in req.model_fields_set,
                  _logprob(req, req.logprobs, bool(req.echo)), "/v1/completions")
    return await CompletionShaper(sub, req, tok, prompts, given, state.args.enable_cache_report).respond(request)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state, req = server_state(request), await _parse(request, ChatCompletionRequest)
    tok = _check(state, req)
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs to be true.")
    if req.top_logprobs is not None and req.top_logprobs > state.args.max_logprobs:
        raise ApiError(400, f"top_logprobs must be at most {state.args.max_logprobs} (--max-logprobs), "
                            f"got {req.top_logprobs}.", {"param": "top_logprobs"})
    prompt = chat_prompt_ids(tok, req)
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    top = (req.top_logprobs or 0) if req.logprobs else None
    sub = _submit(state, req, [prompt], max_new, True, _logprob(req, top, False), "/v1/chat/completions")
    return await ChatShaper(sub, req, tok, [prompt], state.args.enable_cache_report).respond(request)
