"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions (http_api.md §3).

Every request is parsed, tokenized, validated and submitted before a response starts, so bad input
is a 400 (flat OpenAI envelope, server/errors.py) even for `stream: true`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from engine.request import LogprobOptions, RequestOutput
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer
from server.errors import ApiError, media_type, not_json_message
from server.openai_convert import (
    ChatLogprobCursor,
    CompletionLogprobCursor,
    chat_prompt_ids,
    finish_fields,
    raise_if_failed,
    usage_of,
)
from server.openai_protocol import (
    WEIGHT_VERSION,
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChoiceLogprobs,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    SamplingFields,
)
from server.openai_stream import Job, chat_stream, collect, completion_stream
from server.state import ServerState

router = APIRouter()
M = TypeVar("M", bound=BaseModel)


def _state(request: Request) -> ServerState:
    return request.app.state.server


def _model_card(state: ServerState) -> dict[str, Any]:
    name = state.model_name
    return {"id": name, "object": "model", "created": int(state.started), "owned_by": "sglang", "root": name,
            "parent": None, "max_model_len": state.context_len}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(_state(request))]}


@router.get("/v1/models/{model_id:path}")
async def retrieve_model(model_id: str, request: Request) -> Response:
    state = _state(request)
    if model_id != state.model_name:
        return JSONResponse(status_code=404, content={"error": {
            "message": f"The model '{model_id}' does not exist", "type": "invalid_request_error",
            "param": "model", "code": "model_not_found"}})
    return JSONResponse(_model_card(state))


# ---- request handling shared by both generation routes ----------------------------------------------
async def _parse(request: Request, model: type[M]) -> M:
    """The JSON body as `model`; anything else (wrong Content-Type, bad JSON, bad types) is a 400."""
    ctype = request.headers.get("content-type", "")
    if media_type(ctype) != "application/json":
        raise ApiError(400, not_json_message(ctype))
    try:
        return model.model_validate_json(await request.body())
    except ValidationError as e:
        parts = []
        for err in e.errors():
            loc = ".".join(str(x) for x in err.get("loc", ()))
            parts.append(f"{loc or 'body'}: {err.get('msg', 'invalid value')}")
        raise ApiError(400, "Invalid request: " + "; ".join(parts)) from None


def _tokenizer(state: ServerState, req: SamplingFields) -> Tokenizer:
    if (problem := req.unsupported()) is not None:
        raise ApiError(400, problem)
    if state.tokenizer is None:
        raise ApiError(400, "the OpenAI routes need a tokenizer; this server runs with --skip-tokenizer-init.")
    return state.tokenizer


def _submit(state: ServerState, req: SamplingFields, prompts: list[list[int]], max_new_tokens: int | None,
            logprob: LogprobOptions | None) -> Job:
    """Validate every prompt, then queue them all (n samples each); nothing is queued if any is invalid."""
    asked, cap = max_new_tokens, state.args.max_new_tokens_cap
    if cap is not None and asked is not None and asked > cap:
        raise ApiError(400, f"max_tokens ({asked}) exceeds this server's limit of {cap} tokens.")
    # no limit asked: until EOS, the cap, or the context (the engine stops there with "length")
    params = SamplingParams.from_dict(req.sampling_dict(cap if asked is None else asked))
    ctx = state.context_len
    for ids in prompts:
        state.engine.validate(ids, params, logprob or LogprobOptions())
        if asked is not None and len(ids) + asked > ctx:
            raise ApiError(400, f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                                f"You requested a total of {len(ids) + asked} tokens: {len(ids)} tokens from the "
                                f"input messages and {asked} tokens for the completion. Please reduce the number "
                                "of tokens in the input messages or the completion to fit within the limit.")
    if len(prompts) * params.n > state.args.max_batch_size:
        raise ApiError(400, f"{len(prompts)} prompts x n={params.n} exceeds the server's limit of "
                            f"{state.args.max_batch_size} samples per request (--max-batch-size).")
    base = req.rid or uuid.uuid4().hex
    ae, rids, queued = state.async_engine, [], []
    try:
        for p, ids in enumerate(prompts):
            rid = base if len(prompts) == 1 else f"{base}_{p}"
            rids += ae.submit(ids, params, logprob, rid)
            queued.append(rid)
    except BaseException:
        for rid in queued:  # a prefix abort also ends the samples and the shared prefill of n > 1
            ae.abort(rid)
        raise
    # NOTE: no await since submit: every sample is still in AsyncEngine's table, so opening works.
    return Job(ae=ae, id=base, created=int(time.time()), model=req.model, rids=rids, n=params.n,
               prompt_lens=[len(ids) for ids in prompts], streams=[ae.stream(r) for r in rids])


async def _disconnected(request: Request) -> None:
    """Return once the client has gone (the body is already read: the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(request: Request, job: Job) -> list[RequestOutput]:
    """Final outputs of every choice; a client that disconnects meanwhile aborts them all."""
    results = asyncio.ensure_future(collect(job))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({results, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not results.done() and gone.exception() is None:
            raise ApiError(499, "the client disconnected; the request was aborted.")
        outs = await results  # (the watcher failed: just wait)
        for out in outs:
            raise_if_failed(out)
        return outs
    finally:
        for task in (results, gone):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        job.abort_unfinished()  # also covers a reader cancelled before it started


def document_request_bodies(schema: dict[str, Any]) -> None:
    """Add the JSON request bodies of the two generation routes to an OpenAPI document.

    Both routes parse their body themselves (Content-Type check, OpenAI error envelope), so FastAPI
    cannot see the models; without this, clients and schema-driven tests see no body at all.
    """
    components = schema.setdefault("components", {}).setdefault("schemas", {})
    for path, model in (("/v1/completions", CompletionRequest), ("/v1/chat/completions", ChatCompletionRequest)):
        op = schema.get("paths", {}).get(path, {}).get("post")
        if op is None:
            continue
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in body.pop("$defs", {}).items():
            components.setdefault(name, sub)
        components[model.__name__] = body
        op["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    # validation errors are 400 in this server's envelopes (app.py), never FastAPI's 422
    for path, item in schema.get("paths", {}).items():
        for op in item.values():
            responses = op.setdefault("responses", {})
            responses.pop("422", None)
            responses["400"] = {"description": "Bad request: " + (
                "the OpenAI error object" if path.startswith("/v1/") else '{"error": {"message": ...}}')}
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)


# ---- /v1/completions ---------------------------------------------------------------------------------
def _completion_prompts(tok: Tokenizer, prompt: str | list[str] | list[int] | list[list[int]]
                        ) -> tuple[list[list[int]], list[str | list[int]]]:
    """(token ids per prompt, the prompts as given) from the four accepted shapes."""
    given: list[Any] = [prompt] if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)) else prompt
    if not given or any(len(p) == 0 for p in given):
        raise ApiError(400, "Prompt cannot be empty")
    return [tok.encode(p) if isinstance(p, str) else list(p) for p in given], given


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = _state(request)
    req = await _parse(request, CompletionRequest)
    tok = _tokenizer(state, req)
    prompts, given = _completion_prompts(tok, req.prompt)
    logprob = None
    if req.logprobs is not None:
        logprob = LogprobOptions(return_logprob=True, logprob_start_len=0 if req.echo else -1,
                                 top_logprobs_num=req.logprobs)
    max_tokens, cap = req.max_tokens, state.args.max_new_tokens_cap
    if "max_tokens" not in req.model_fields_set and cap is not None and max_tokens is not None:
        max_tokens = min(max_tokens, cap)  # the default (16) yields to the server's cap; explicit values do not
    job = _submit(state, req, prompts, max_tokens, logprob)
    if req.echo:
        job.prompt_texts = [p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False) for p in given]
    if req.stream:
        return completion_stream(tok, job, req)
    outs = await _collect(request, job)
    choices = []
    for i, out in enumerate(outs):
        reason, matched = finish_fields(out.finish_reason)
        lp = CompletionLogprobCursor(tok, bool(req.echo)).take(out.logprobs) if logprob else None
        text = job.prompt_texts[i // job.n] + out.text if req.echo else out.text
        choices.append(CompletionChoice(index=i, text=text, logprobs=lp, finish_reason=reason, matched_stop=matched))
    resp = CompletionResponse(id=job.id, created=job.created, model=job.model, choices=choices,
                              usage=usage_of(job.prompt_lens, outs), metadata={"weight_version": WEIGHT_VERSION})
    return JSONResponse(resp.model_dump(mode="json"))


# ---- /v1/chat/completions ----------------------------------------------------------------------------
@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = _state(request)
    req = await _parse(request, ChatCompletionRequest)
    tok = _tokenizer(state, req)
    if req.top_logprobs and not req.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs to be true.")
    prompt = chat_prompt_ids(tok, req)
    logprob = LogprobOptions(return_logprob=True, top_logprobs_num=req.top_logprobs or 0) if req.logprobs else None
    max_new = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    job = _submit(state, req, [prompt], max_new, logprob)
    if req.stream:
        return chat_stream(tok, job, req)
    outs = await _collect(request, job)
    choices = []
    for i, out in enumerate(outs):
        reason, matched = finish_fields(out.finish_reason)
        lp = ChoiceLogprobs(content=ChatLogprobCursor(tok).take(out.logprobs)) if logprob else None
        choices.append(ChatChoice(index=i, message=AssistantMessage(content=out.text), logprobs=lp,
                                  finish_reason=reason, matched_stop=matched))
    resp = ChatCompletionResponse(id=job.id, created=job.created, model=job.model, choices=choices,
                                  usage=usage_of(job.prompt_lens, outs))
    return JSONResponse(resp.model_dump(mode="json"))
