"""SGLang-native routes: /generate (POST and PUT), /abort_request, /flush_cache (http_api.md §1, §3), with the
info, pool and utility routes of `server.routes_admin`. `plan_generate` makes the engine's requests of a
/generate body (the engine validates the values, and duplicate rids), `NativeShaper` its bodies and frames."""

import json
import logging
import math
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, Response

from engine.runtime.request import JoinedOutput, LogprobOptions, Logprobs, NewRequest, RequestOutput
from engine.runtime.sampling_params import SamplingParams
from engine.runtime.tokenizer import Tokenizer
from server.async_engine import merge
from server.errors import BadRequest
from server.protocol import AbortReq, GenerateReqInput
from server.routes_admin import router as admin_router
from server.state import server_state
from server.submission import Submission, respond, sampling_params

logger, router = logging.getLogger(__name__), APIRouter()
router.include_router(admin_router)

FLUSH_NOTE = ("\nPlease check backend logs for more details. (When there are running or waiting requests, the "
              "operation will not be performed.)\n")


def _prompts(req: GenerateReqInput, tok: Tokenizer | None) -> tuple[list[list[int]], bool]:
    """The prompts as token ids, and whether the input was a scalar (one prompt, not a batch)."""
    if req.input_embeds is not None:
        raise BadRequest("input_embeds is not supported by this server; send text or input_ids.")
    if (req.text is None) == (req.input_ids is None):
        raise BadRequest("Either text, input_ids or input_embeds should be provided." if req.text is None
                         else "Either text or input_ids should be provided, not both.")
    if (ids := req.input_ids) is not None:
        return ([list(ids)], True) if not ids or isinstance(ids[0], int) else ([list(x) for x in ids], False)
    if tok is None:
        raise BadRequest("text input needs a tokenizer, but this server runs with --skip-tokenizer-init: "
                         "send input_ids instead.")
    texts = [req.text] if isinstance(req.text, str) else list(req.text)
    prompts = [tok.encode(t) for t in texts]
    if [] in prompts:
        raise BadRequest(f"text {texts[prompts.index([])]!r} encodes to no tokens; send a non-empty prompt.")
    return prompts, isinstance(req.text, str)


def _per_prompt(name: str, value: Any, k: int, n: int, default: Any, listy: bool = False) -> list[Any]:
    """Broadcast a scalar argument (None: `default`), or check a per-prompt list against the batch."""
    if not isinstance(value, list) or (listy and not (value and isinstance(value[0], list))):
        return [default if value is None else value] * k
    if n > 1:
        raise BadRequest(f"{name} given as a list is not supported together with n > 1 (n={n}).")
    if len(value) != k:
        raise BadRequest(f"{name} has {len(value)} entries but the batch has {k} prompts.")
    return list(value)


def _rids(rid: str | list[str] | None, k: int, single: bool) -> list[str]:
    if rid is None:
        return [uuid.uuid4().hex for _ in range(k)]
    if isinstance(rid, str):
        return [rid] if single else [f"{rid}_{i}" for i in range(k)]
    if len(rid) != k:
        raise BadRequest(f"The specified rids length ({len(rid)}) should be equal to the batch size ({k}).")
    return list(rid)


def plan_generate(req: GenerateReqInput, tok: Tokenizer | None, cap: int | None) -> tuple[list[NewRequest], bool]:
    """The engine requests of a /generate body, and whether the response is one object, not a list (one prompt
    given as a scalar, n == 1); raises BadRequest for shape and batch errors."""
    prompts, scalar = _prompts(req, tok)
    if (k := len(prompts)) == 0:
        raise BadRequest("The batch is empty: give at least one prompt.")
    raws = _per_prompt("sampling_params", req.sampling_params, k, 1, {})
    params = [sampling_params(r, cap, SamplingParams.max_new_tokens) for r in raws]
    n = params[0].n
    if any(p.n != n for p in params):
        raise BadRequest("The parallel_sample_num should be the same for all samples in sample params.")
    ret = _per_prompt("return_logprob", req.return_logprob, k, n, False)
    start = _per_prompt("logprob_start_len", req.logprob_start_len, k, n, -1)
    top = _per_prompt("top_logprobs_num", req.top_logprobs_num, k, n, 0)
    ids = _per_prompt("token_ids_logprob", req.token_ids_logprob, k, n, None, listy=True)
    rids = _rids(req.rid, k, scalar)
    lps = [LogprobOptions(True, start[i], top[i], list(ids[i]) if ids[i] else None) if ret[i] else LogprobOptions()
           for i in range(k)]
    return [NewRequest(prompt, params[i], lps[i], rids[i]) for i, prompt in enumerate(prompts)], scalar and n == 1


class NativeShaper:
    def __init__(self, sub: Submission, reqs: list[NewRequest], single: bool, tok: Tokenizer | None,
                 text_in_logprobs: bool, incremental: bool) -> None:
        self.sub, self.single, self.tok, self.incremental = sub, single, tok, incremental
        self.text_in_logprobs = text_in_logprobs and tok is not None
        self.opts = [r.logprob for r in reqs for _ in range(r.params.n)]
        self.interval = [max(1, r.params.stream_interval or 1) for r in reqs for _ in range(r.params.n)]
        self._sent = [0] * len(self.opts)  # completion tokens at each sequence's last frame
        self._pending: dict[int, RequestOutput] = {}  # deltas not sent yet (stream_interval, incremental)
        self._texts: dict[int, str] = {}

    def body(self, i: int, res: JoinedOutput) -> dict[str, Any]:
        """The whole result so far (the non-stream response; a cumulative stream frame)."""
        return self._shape(i, res.last, res.text, res.output_ids, res.logprobs)

    def response(self, joined: list[JoinedOutput]) -> Any:
        bodies = [self.body(i, res) for i, res in enumerate(joined)]
        return bodies[0] if self.single else bodies

    def frame(self, i: int, out: RequestOutput) -> str | None:
        """The stream frame for sequence i's new output, or None while stream_interval holds it."""
        if i in self._pending:
            out = merge(self._pending.pop(i), out)
        if not out.finished and self._sent[i] and out.completion_tokens - self._sent[i] < self.interval[i]:
            self._pending[i] = out
            return None
        self._sent[i] = out.completion_tokens
        body = (self._shape(i, out, out.new_text, out.new_ids, out.logprobs) if self.incremental
                else self.body(i, self.sub.joined[i]))
        if not self.single:
            body["index"] = i
        return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

    def _shape(self, i: int, out: RequestOutput, text: str, ids: list[int], lp: Logprobs | None) -> dict[str, Any]:
        meta: dict[str, Any] = {"id": out.rid, "finish_reason": out.finish_reason if out.finished else None,
                                "prompt_tokens": out.prompt_tokens, "completion_tokens": out.completion_tokens,
                                "cached_tokens": out.cached_tokens, "weight_version": "default",
                                "num_retractions": out.num_retractions}
        if out.finished:
            meta["e2e_latency"] = round(time.monotonic() - self.sub.started, 6)
        if self.opts[i].return_logprob:
            lp = lp or Logprobs()
            meta |= {"input_token_logprobs": self._entries(lp.input_token),
                     "output_token_logprobs": self._entries(lp.output_token), "output_token_logprobs_length": len(ids)}
            if self.opts[i].top_logprobs_num > 0:
                meta["input_top_logprobs"] = [self._entries(p) for p in lp.input_top]
                meta["output_top_logprobs"] = [self._entries(p) for p in lp.output_top]
            if self.opts[i].token_ids_logprob:
                meta["input_token_ids_logprobs"] = [self._entries(p) for p in lp.input_ids]
                meta["output_token_ids_logprobs"] = [self._entries(p) for p in lp.output_ids]
        return ({"text": text} if self.tok is not None else {}) | {"output_ids": list(ids), "meta_info": meta}

    def _entries(self, entries: list | None) -> list[list[Any]] | None:
        # NOTE: JSON has no -inf; a logprob that underflowed is sent as null.
        if entries is None:
            return None
        return [[v if v is None or math.isfinite(v) else None, t, self._text(t)] for v, t in entries]

    def _text(self, token_id: int) -> str | None:
        if self.text_in_logprobs and token_id not in self._texts:
            self._texts[token_id] = self.tok.decode([token_id])  # type: ignore[union-attr]
        return self._texts.get(token_id)


@router.put("/generate", operation_id="generate_put")
@router.post("/generate", operation_id="generate")
async def generate(body: GenerateReqInput, request: Request) -> Response:
    """Text or token ids in; one object (single prompt, n=1) or a list out; SSE with `stream`."""
    started, state = time.monotonic(), server_state(request)
    reqs, single = plan_generate(body, state.engine.tokenizer, state.args.engine.max_new_tokens_cap)
    sub = Submission(state.async_engine, reqs, "/generate", started)  # 400 / 503 before anything starts
    shaper = NativeShaper(sub, reqs, single, state.engine.tokenizer, bool(body.return_text_in_logprobs),
                          state.args.incremental_streaming_output)
    return await respond(sub, request, bool(body.stream), shaper.frame, shaper.response)


@router.post("/abort_request")
async def abort_request(body: AbortReq, request: Request) -> Response:
    """Abort by rid (also its `rid_*` samples) or everything; an empty rid alone aborts nothing."""
    if body.abort_all or body.rid:
        server_state(request).async_engine.abort(body.rid, body.abort_all)
    return Response(status_code=200)


@router.post("/flush_cache", operation_id="flush_cache_post")
@router.get("/flush_cache", operation_id="flush_cache")
async def flush_cache(request: Request) -> Response:
    """Drop the prefix cache; refused with 400 while requests are queued or running."""
    ae = (state := server_state(request)).async_engine
    if ae.num_in_flight() == 0 and await ae.on_engine_thread(state.engine.flush_cache):  # it runs torch
        logger.info("prefix cache flushed")
        return PlainTextResponse("Cache flushed." + FLUSH_NOTE)
    logger.warning("cache not flushed: requests are running or waiting")
    return PlainTextResponse("Cache not flushed." + FLUSH_NOTE, status_code=400)
