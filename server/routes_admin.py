"""Native info and utility routes: /health_generate, /model_info, /server_info (and deprecated `/get_*` aliases),
/get_load, /tokenize, /detokenize, /metrics (http_api.md §3); the pool introspection routes /pools... (§6). NOTE: counts
are read on the event loop while the engine thread runs: plain ints, so a reading is at worst one step old."""

import asyncio
import logging
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from engine.runtime.request import NewRequest
from engine.runtime.sampling_params import SamplingParams
from mem_cache import LayerIdError, MissingBufferError
from server import __version__
from server.errors import ApiError, BadRequest, error_response
from server.metrics import CONTENT_TYPE
from server.protocol import DetokenizeReq, TokenizeReq
from server.state import ServerState, server_state
from server.submission import Submission

logger, router = logging.getLogger(__name__), APIRouter()
HEALTH_TIMEOUT_S = 20.0


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """One greedy token from `input_ids=[0]`: 200 if the engine answers within 20 s, else 503."""
    if not (state := server_state(request)).healthy:
        return Response(status_code=503)
    req = NewRequest([0], SamplingParams(max_new_tokens=1, temperature=0.0), rid=f"HEALTH_CHECK_{uuid.uuid4().hex}")
    sub = Submission(state.async_engine, [req], "/health_generate")
    try:
        (res,) = await asyncio.wait_for(sub.collect(request), HEALTH_TIMEOUT_S)
    except (asyncio.TimeoutError, ApiError):
        logger.error("health_generate: no answer from the engine within %.0f s", HEALTH_TIMEOUT_S)
        return Response(status_code=503)
    except Exception:  # the client left: nobody reads the status
        return Response(status_code=503)
    return Response(status_code=503 if (res.last.finish_reason or {}).get("type") == "abort" else 200)


@router.get("/get_model_info", deprecated=True)
@router.get("/model_info")
async def model_info(request: Request) -> dict[str, Any]:
    state = _state_warn_if_deprecated(request)
    flat, cfg = state.args.flat(), state.engine.cfg
    return {"model_path": flat["model_path"],
            "tokenizer_path": None if flat["skip_tokenizer_init"] else flat["tokenizer_path"] or flat["model_path"],
            "is_generation": True, "preferred_sampling_params": None, "weight_version": "default",
            "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": cfg.model_type, "architectures": list(cfg.architectures)}


@router.get("/get_server_info", deprecated=True)
@router.get("/server_info")
async def server_info(request: Request) -> dict[str, Any]:
    state = _state_warn_if_deprecated(request)
    integrity_ok = await state.async_engine.check_integrity()  # on the engine thread, between two steps
    eng, args, st, ae = state.engine, state.args, state.engine.stats(), state.async_engine
    info: dict[str, Any] = args.flat() | ({"api_key": "<redacted>"} if args.api_key else {})
    return info | {
        "max_new_tokens_cap": info["max_new_tokens_cap"] or eng.context_len,  # the limit in force
        "served_model_name": args.model_name, "context_len": eng.context_len,
        "max_total_num_tokens": st.max_total_tokens, "max_req_input_len": min(eng.context_len, st.max_total_tokens) - 1,
        "status": state.status(), "dp_size": 1, "captured_decode_batch_sizes": list(st.captured_batch_sizes),
        "decode_graphs": eng.decode_graphs(), "internal_states": [{
            "last_gen_throughput": state.metrics.gen_throughput() if state.metrics is not None else None,
            "num_running_reqs": st.num_running, "num_queue_reqs": st.num_waiting, "num_used_tokens": st.used_tokens,
            "token_usage": st.token_usage, "memory_usage": {"kv_cache_bytes": st.kv_cache_bytes},
            "num_in_flight": ae.num_in_flight(), "num_pending_outputs": ae.num_pending_outputs(),
            "integrity_ok": integrity_ok,  # KV slots: free + requests' + prefix cache's == pool size, none twice
        }], "uptime_s": round(time.time() - state.started, 3), "version": __version__}


def _state_warn_if_deprecated(request: Request) -> ServerState:
    if (path := request.url.path).startswith("/get_"):
        logger.warning("%s is deprecated; use %s", path, path.removeprefix("/get"))
    return server_state(request)


def _tokenizer(request: Request) -> tuple[ServerState, Any]:
    if (state := server_state(request)).engine.tokenizer is None:
        raise ApiError(400, "this server runs with --skip-tokenizer-init: it has no tokenizer.")
    return state, state.engine.tokenizer


@router.get("/get_load")
async def get_load(request: Request) -> list[dict[str, int]]:
    """SGLang's load report, one entry per data-parallel rank (we have one): sglang-router's load signal."""
    st = server_state(request).engine.stats()
    return [{"dp_rank": 0, "num_reqs": st.num_running + st.num_waiting, "num_waiting_reqs": st.num_waiting,
             "num_tokens": st.used_tokens}]


@router.post("/tokenize")
async def tokenize(body: TokenizeReq, request: Request) -> dict[str, Any]:
    state, tok = _tokenizer(request)
    if isinstance(body.prompt, str):
        ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return {"tokens": ids, "count": len(ids), "max_model_len": state.engine.context_len}
    batch = [tok.encode(p, add_special_tokens=body.add_special_tokens) for p in body.prompt]
    return {"tokens": batch, "count": [len(x) for x in batch], "max_model_len": state.engine.context_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeReq, request: Request) -> dict[str, Any]:
    state, tok = _tokenizer(request)
    vocab = state.engine.cfg.vocab_size
    seqs = [body.tokens] if not body.tokens or isinstance(body.tokens[0], int) else body.tokens
    bad = next((t for seq in seqs for t in seq if not 0 <= t < vocab), None)  # type: ignore[operator]
    if bad is not None:
        raise ApiError(400, f"tokens must be in [0, {vocab - 1}], got {bad}.")
    texts = [tok.decode(list(s), skip_special_tokens=body.skip_special_tokens) for s in seqs]  # type: ignore[arg-type]
    return {"text": texts[0] if seqs is not body.tokens else texts}


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    if (m := server_state(request).metrics) is None:
        return error_response(request, 404, "metrics are disabled; start the server with --enable-metrics")
    return Response(m.render(), media_type=CONTENT_TYPE)


def _pool_info(request: Request, layer_id: int, buffer: str | None = None) -> dict[str, Any]:
    pool = server_state(request).engine.pool
    try:
        return pool.layer_info(layer_id) if buffer is None else pool.buffer_info(layer_id, buffer)
    except (LayerIdError, MissingBufferError) as e:
        raise ApiError(404 if isinstance(e, LayerIdError) else 409, str(e)) from None
    except ValueError as e:  # an unknown buffer name
        raise BadRequest(str(e)) from None


@router.get("/pools")
async def pools(request: Request) -> dict[str, Any]:
    pool, st = (eng := server_state(request).engine).pool, eng.stats()
    return {"pool_class": type(pool).__name__, "device": str(pool.device),
            "dtype": str(pool.dtype).removeprefix("torch."), "page_size": pool.page_size,
            "size_tokens": st.max_total_tokens, "used_tokens": st.used_tokens, "free_tokens": st.free_tokens,
            "evictable_tokens": st.evictable_tokens, "bytes_per_token": pool.bytes_per_token(),
            "total_bytes": pool.total_bytes(), "sub_pools": pool.sub_pools_info(), "host_tier": st.host_tier}


@router.get("/pools/layers")
async def layers(request: Request) -> dict[str, Any]:
    return {"layers": server_state(request).engine.pool.layers_info()}


@router.get("/pools/layers/{layer_id}")
async def layer(layer_id: int, request: Request) -> dict[str, Any]:
    return _pool_info(request, layer_id)


@router.get("/pools/layers/{layer_id}/buffers/{buffer}")
async def buffer(layer_id: int, buffer: str, request: Request) -> dict[str, Any]:
    return _pool_info(request, layer_id, buffer)
