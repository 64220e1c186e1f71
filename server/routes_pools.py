"""Pool introspection routes (http_api.md §6): metadata about the KV pools, never tensor contents.

Counts are read from the event-loop thread while the engine thread runs; they are plain ints, so a
reading is at worst one step old. Errors: unknown layer -> 404, a buffer the layer lacks -> 409 (the
pool's MissingBufferError message), unknown buffer name or non-integer layer id -> 400.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from mem_cache import BUFFER_NAMES, LayerIdError, MiniMaxSparseKVPool, MissingBufferError
from mem_cache.pool_info import dtype_name
from server.errors import ApiError
from server.state import server_state

router = APIRouter()


def _pool(request: Request) -> MiniMaxSparseKVPool:
    return server_state(request).engine.pool


def _layer_or_404(pool: MiniMaxSparseKVPool, layer_id: int) -> None:
    try:
        pool.layer_kind(layer_id)
    except LayerIdError as e:
        raise ApiError(404, str(e)) from None


@router.get("/pools")
async def pools(request: Request) -> dict[str, Any]:
    eng = server_state(request).engine
    pool, st = eng.pool, eng.stats()
    return {
        "pool_class": type(pool).__name__,
        "device": str(pool.device),
        "dtype": dtype_name(pool.dtype),
        "page_size": pool.page_size,
        "size_tokens": st.max_total_tokens,
        "used_tokens": st.used_tokens,
        "free_tokens": st.free_tokens,
        "evictable_tokens": st.evictable_tokens,
        "bytes_per_token": pool.bytes_per_token(),
        "total_bytes": pool.total_bytes(),
        "sub_pools": pool.sub_pools_info(),
    }


@router.get("/pools/layers")
async def layers(request: Request) -> dict[str, Any]:
    return {"layers": _pool(request).layers_info()}


@router.get("/pools/layers/{layer_id}")
async def layer(layer_id: int, request: Request) -> dict[str, Any]:
    pool = _pool(request)
    _layer_or_404(pool, layer_id)
    return pool.layer_info(layer_id)


@router.get("/pools/layers/{layer_id}/buffers/{buffer}")
async def buffer(layer_id: int, buffer: str, request: Request) -> dict[str, Any]:
    pool = _pool(request)
    _layer_or_404(pool, layer_id)
    if buffer not in BUFFER_NAMES:
        raise ApiError(400, f"unknown buffer {buffer!r}; valid buffer names are {list(BUFFER_NAMES)}")
    try:
        return pool.buffer_info(layer_id, buffer)
    except MissingBufferError as e:
        raise ApiError(409, str(e)) from None
