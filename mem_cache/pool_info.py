"""Layer kinds, buffer names and their routes (model.md §5), and `MiniMaxSparseKVPool`'s introspection and self-check:
metadata, never tensor contents (GET /pools..., http_api.md §6). Generic code asks here what a layer lacks."""

from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

from mem_cache.errors import MissingBufferError
from mem_cache.kv_pool import MHATokenToKOnlyPool, MHATokenToKVPool, check_layer_id

DENSE, SPARSE_INDEX_KV, SPARSE_K_ONLY = "dense", "sparse_index_kv", "sparse_k_only"
LAYER_KINDS: tuple[str, ...] = (DENSE, SPARSE_INDEX_KV, SPARSE_K_ONLY)
BUFFER_NAMES: tuple[str, ...] = ("key", "value", "index_key", "index_value")  # the introspection API's (http_api.md §6)
KIND_BUFFERS: MappingProxyType[str, frozenset[str]] = MappingProxyType({DENSE: frozenset({"key", "value"}),
    SPARSE_INDEX_KV: frozenset(BUFFER_NAMES), SPARSE_K_ONLY: frozenset({"key", "value", "index_key"})})


@dataclass(frozen=True)
class BufferLocation:
    """Where one buffer of one global layer lives: a sub-pool and the local layer id inside it."""

    pool: MHATokenToKVPool | MHATokenToKOnlyPool
    local_layer_id: int


def validate_layer_kinds(layer_kinds: Sequence[str]) -> tuple[str, ...]:
    if not (kinds := tuple(layer_kinds)):
        raise ValueError("layer_kinds is empty: a pool needs at least one layer")
    for i, kind in enumerate(kinds):
        if kind not in LAYER_KINDS:
            raise ValueError(f"layer_kinds[{i}] = {kind!r} is not one of {list(LAYER_KINDS)}")
    return kinds


def check_buffer_name(buffer: str) -> None:
    if buffer not in BUFFER_NAMES:
        raise ValueError(f"unknown buffer {buffer!r}; valid buffer names are {list(BUFFER_NAMES)}")


def elements_per_token(kind: str, head_num: int, head_dim: int, index_head_dim: int) -> int:
    """Cached elements per token for ONE layer of a known `kind` (model.md §5): main K and V, and its index buffers."""
    return 2 * head_num * head_dim + index_head_dim * len(KIND_BUFFERS[kind] - {"key", "value"})


class SparsePoolInfoMixin:
    """Introspection half of `MiniMaxSparseKVPool`, over the attributes its `__init__` sets (`_routes`: per global
    layer, each buffer's `BufferLocation`, or None where it lacks it); all `layer_id` arguments are GLOBAL layer ids."""

    def layer_kind(self, layer_id: int) -> str:
        check_layer_id(layer_id, self.num_layers)
        return self.layer_kinds[layer_id]

    def buffer_location(self, layer_id: int, buffer: str) -> BufferLocation | None:
        """The sub-pool and local id holding `buffer` of `layer_id`, or None if the layer lacks it."""
        check_layer_id(layer_id, self.num_layers)
        check_buffer_name(buffer)
        return self._routes[layer_id][buffer]

    def has_buffer(self, layer_id: int, buffer: str) -> bool:
        return self.buffer_location(layer_id, buffer) is not None

    def has_value_buffer(self, layer_id: int) -> bool:
        """Main V exists for every layer (dense and sparse)."""
        return self.has_buffer(layer_id, "value")

    def has_index_value_buffer(self, layer_id: int) -> bool:
        return self.has_buffer(layer_id, "index_value")

    def layers_with(self, buffer: str) -> list[int]:
        """Global ids of the layers that have `buffer`."""
        check_buffer_name(buffer)
        return [i for i in range(self.num_layers) if self._routes[i][buffer] is not None]

    def layer_bytes_per_token(self, layer_id: int) -> int:
        kind = self.layer_kind(layer_id)
        return elements_per_token(kind, self.head_num, self.head_dim, self.index_head_dim) * self.dtype.itemsize

    def sub_pools(self) -> list[MHATokenToKVPool | MHATokenToKOnlyPool]:
        """The sub-pools that exist (those with at least one layer), main first."""
        return [p for p in (self.main_pool, self.index_kv_pool, self.index_k_pool) if p is not None]

    def layer_info(self, layer_id: int) -> dict[str, Any]:
        """One LayerInfo (http_api.md §6): kind, which buffers exist, where, their shapes, bytes/token."""
        kind, routes = self.layer_kind(layer_id), self._routes[layer_id]
        return {"layer_id": layer_id, "attention": "dense" if kind == DENSE else "sparse", "kind": kind,
                "buffers": {b: routes[b] is not None for b in BUFFER_NAMES},
                "locations": {b: r and {"pool": r.pool.name, "local_layer_id": r.local_layer_id}
                              for b, r in routes.items()},
                "shapes": {b: r and list(r.pool.buffer_shape) for b, r in routes.items()},
                "bytes_per_token": self.layer_bytes_per_token(layer_id)}

    def layers_info(self) -> list[dict[str, Any]]:
        return [self.layer_info(i) for i in range(self.num_layers)]

    def buffer(self, layer_id: int, buffer: str) -> torch.Tensor:
        """The tensor of one buffer of one layer, `[size + 1, heads, dim]`; `MissingBufferError` if it lacks it."""
        if (loc := self.buffer_location(layer_id, buffer)) is not None:
            get = loc.pool.get_key_buffer if buffer in ("key", "index_key") else loc.pool.get_value_buffer
            return get(loc.local_layer_id)
        kind, owners = self.layer_kinds[layer_id], self.layers_with(buffer)
        tail = f"only layers {owners} have '{buffer}'." if owners else f"no layer of this model has '{buffer}'."
        if kind == SPARSE_K_ONLY:  # the only buffer a K-only layer lacks is index_value
            msg = (f"layer {layer_id} is a score-only sparse layer (sparse_disable_index_value): its index K lives in "
                   f"MHATokenToKOnlyPool, which does not allocate V. Use buffer 'index_key' for the index keys; {tail}")
        else:  # dense (NOTE: KIND_BUFFERS gives a sparse_index_kv layer every buffer)
            msg = (f"layer {layer_id} is a dense layer: it has no indexer, so it has only buffers 'key' and "
                   f"'value' (in {self.main_pool.name}). Use buffer 'key' / 'value' for its attention K/V; {tail}")
        raise MissingBufferError(msg, layer_id, buffer)

    def buffer_info(self, layer_id: int, buffer: str) -> dict[str, Any]:
        """Metadata of one real buffer; `MissingBufferError` (says why, what to use) if the layer lacks it."""
        loc, t = self.buffer_location(layer_id, buffer), self.buffer(layer_id, buffer)
        return {"layer_id": layer_id, "buffer": buffer, "pool": loc.pool.name, "pool_class": type(loc.pool).__name__,
                "local_layer_id": loc.local_layer_id, "shape": list(t.shape),
                "dtype": str(t.dtype).removeprefix("torch."), "bytes": t.numel() * t.element_size()}

    def sub_pools_info(self) -> list[dict[str, Any]]:
        return [{"name": p.name, "class": type(p).__name__, "layer_ids": list(p.global_layer_ids),
                 "head_num": p.head_num, "head_dim": p.head_dim, "has_key": True, "has_value": p.has_value_buffer,
                 "bytes": p.total_bytes()} for p in self.sub_pools()]

    def check_integrity(self) -> bool:
        for pool in self.sub_pools():
            assert pool.has_value_buffer or not hasattr(pool, "v_buffer"), f"'{pool.name}': a K-only pool holds V"
            assert (pool.size, pool.dtype) == (self.size, self.dtype), f"'{pool.name}': size/dtype not the parent's"
        for layer_id, (kind, routes) in enumerate(zip(self.layer_kinds, self._routes)):
            present = {b for b, r in routes.items() if r is not None}
            assert set(routes) == set(BUFFER_NAMES) and present == KIND_BUFFERS[kind], (
                f"layer {layer_id} ({kind}) routes {sorted(present)}")
            for buffer in present:
                r, t = routes[buffer], self.buffer(layer_id, buffer)
                assert r.pool.global_layer_ids[r.local_layer_id] == layer_id, (
                    f"layer {layer_id} {buffer}: local id {r.local_layer_id} of {r.pool.name} maps to another layer")
                assert buffer in ("key", "index_key") or r.pool.has_value_buffer, f"layer {layer_id} {buffer}: no V"
                heads, dim = (self.head_num, self.head_dim) if buffer in ("key", "value") else (1, self.index_head_dim)
                assert tuple(t.shape) == (self.size + 1, heads, dim) and t.dtype == self.dtype, (
                    f"layer {layer_id} {buffer}: {tuple(t.shape)} {t.dtype} in {r.pool.name}")
                assert t.device.type == self.device.type and self.device.index in (None, t.device.index), (
                    f"layer {layer_id} {buffer}: on {t.device}, the pool on {self.device}")
        return True
