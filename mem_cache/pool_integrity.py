"""Structural self-check of `MiniMaxSparseKVPool` (shapes, dtypes, routing, no V in the K-only pool)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from mem_cache.kv_pool import MHATokenToKOnlyPool, MHATokenToKVPool
from mem_cache.layer_kinds import BUFFER_NAMES, KIND_BUFFERS, SPARSE_INDEX_KV, SPARSE_K_ONLY

if TYPE_CHECKING:
    from mem_cache.sparse_pool import MiniMaxSparseKVPool


def _same_device(t: torch.Tensor, device: torch.device) -> bool:
    return t.device.type == device.type and (device.index is None or t.device.index == device.index)


def _check_sub_pool(
    parent: MiniMaxSparseKVPool,
    pool: MHATokenToKVPool | MHATokenToKOnlyPool,
    head_num: int,
    head_dim: int,
    layer_ids: list[int],
) -> None:
    tag = f"{type(pool).__name__} '{pool.name}'"
    assert (pool.size, pool.dtype) == (parent.size, parent.dtype), (
        f"{tag}: size/dtype {(pool.size, pool.dtype)} differ from the parent's"
    )
    assert (pool.head_num, pool.head_dim) == (head_num, head_dim), (
        f"{tag}: heads x dim {(pool.head_num, pool.head_dim)} != expected {(head_num, head_dim)}"
    )
    assert pool.global_layer_ids == layer_ids, (
        f"{tag}: holds layers {pool.global_layer_ids}, expected {layer_ids}"
    )
    shape = (parent.size + 1, head_num, head_dim)
    tensors = list(pool.k_buffer)
    assert len(pool.k_buffer) == len(layer_ids), (
        f"{tag}: {len(pool.k_buffer)} K buffers for {len(layer_ids)} layers"
    )
    if isinstance(pool, MHATokenToKOnlyPool):
        assert not pool.has_value_buffer and not hasattr(pool, "v_buffer"), f"{tag}: a K-only pool holds V"
    else:
        assert len(pool.v_buffer) == len(layer_ids), f"{tag}: {len(pool.v_buffer)} V buffers"
        tensors += pool.v_buffer
    for t in tensors:
        assert tuple(t.shape) == shape, f"{tag}: buffer shape {tuple(t.shape)} != {shape}"
        assert t.dtype == parent.dtype, f"{tag}: buffer dtype {t.dtype} != {parent.dtype}"
        assert _same_device(t, parent.device), f"{tag}: buffer on {t.device}, pool device {parent.device}"
    expected = len(tensors) * shape[0] * head_num * head_dim * parent.dtype.itemsize
    assert pool.total_bytes() == expected, f"{tag}: total_bytes {pool.total_bytes()} != {expected}"


def check_sparse_pool_integrity(pool: MiniMaxSparseKVPool) -> bool:
    """Raise `AssertionError` with a message on the first inconsistency; return True otherwise."""
    kinds = pool.layer_kinds
    kv_ids = [i for i, k in enumerate(kinds) if k == SPARSE_INDEX_KV]
    k_ids = [i for i, k in enumerate(kinds) if k == SPARSE_K_ONLY]
    _check_sub_pool(pool, pool.main_pool, pool.head_num, pool.head_dim, list(range(pool.num_layers)))
    for sub, ids in ((pool.index_kv_pool, kv_ids), (pool.index_k_pool, k_ids)):
        assert (sub is None) == (not ids), (
            f"sub-pool {sub and sub.name} present={sub is not None} for layers {ids}"
        )
        if sub is not None:
            _check_sub_pool(pool, sub, 1, pool.index_head_dim, ids)
    for layer_id, kind in enumerate(kinds):
        routes = pool._routes[layer_id]
        assert set(routes) == set(BUFFER_NAMES), f"layer {layer_id}: routes for {sorted(routes)}"
        present = {b for b, r in routes.items() if r is not None}
        assert present == KIND_BUFFERS[kind], f"layer {layer_id} ({kind}) routes {sorted(present)}"
        for buffer in present:
            r = routes[buffer]
            assert r is not None
            want = (
                pool.main_pool
                if buffer in ("key", "value")
                else (pool.index_kv_pool if kind == SPARSE_INDEX_KV else pool.index_k_pool)
            )
            assert r.pool is want, f"layer {layer_id} {buffer}: routed to {r.pool.name}"
            assert r.pool.global_layer_ids[r.local_layer_id] == layer_id, (
                f"layer {layer_id} {buffer}: local id {r.local_layer_id} maps back to "
                f"{r.pool.global_layer_ids[r.local_layer_id]}"
            )
            if buffer in ("value", "index_value"):
                assert isinstance(r.pool, MHATokenToKVPool), f"layer {layer_id} {buffer}: pool has no V"
    return True
