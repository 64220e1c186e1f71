"""Capability introspection for `MiniMaxSparseKVPool`: pure metadata, never tensor contents.

This is the data behind GET /pools, /pools/layers and /pools/layers/{id}/buffers/{buffer}
(http_api.md §6). Generic code (metrics, dumps, transfers) asks here first, so it never has to catch
an exception to learn that a layer has no index value buffer.
"""

from __future__ import annotations

from typing import Any

import torch

from mem_cache.errors import MissingBufferError
from mem_cache.kv_pool import MHATokenToKOnlyPool, MHATokenToKVPool, check_layer_id
from mem_cache.layer_kinds import (
    BUFFER_NAMES,
    DENSE,
    SPARSE_K_ONLY,
    BufferLocation,
    check_buffer_name,
    elements_per_token,
)


def dtype_name(dtype: torch.dtype) -> str:
    """`torch.float32` -> "float32"."""
    return str(dtype).removeprefix("torch.")


class SparsePoolInfoMixin:
    """Introspection half of `MiniMaxSparseKVPool`; all `layer_id` arguments are GLOBAL layer ids."""

    layer_kinds: tuple[str, ...]
    num_layers: int
    dtype: torch.dtype
    head_num: int
    head_dim: int
    index_head_dim: int
    main_pool: MHATokenToKVPool
    index_kv_pool: MHATokenToKVPool | None
    index_k_pool: MHATokenToKOnlyPool | None
    _routes: list[dict[str, BufferLocation | None]]

    def _check_layer(self, layer_id: int) -> None:
        check_layer_id(layer_id, self.num_layers)

    def layer_kind(self, layer_id: int) -> str:
        """ "dense" | "sparse_index_kv" | "sparse_k_only"."""
        self._check_layer(layer_id)
        return self.layer_kinds[layer_id]

    def buffer_location(self, layer_id: int, buffer: str) -> BufferLocation | None:
        """The sub-pool and local id holding `buffer` of `layer_id`, or None if the layer lacks it."""
        self._check_layer(layer_id)
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
        return (
            elements_per_token(kind, self.head_num, self.head_dim, self.index_head_dim) * self.dtype.itemsize
        )

    def sub_pools(self) -> list[MHATokenToKVPool | MHATokenToKOnlyPool]:
        """The sub-pools that exist (those with at least one layer), main first."""
        pools = [self.main_pool, self.index_kv_pool, self.index_k_pool]
        return [p for p in pools if p is not None]

    def _buffer_tensor(self, loc: BufferLocation, buffer: str) -> torch.Tensor:
        if buffer in ("key", "index_key"):
            return loc.pool.get_key_buffer(loc.local_layer_id)
        return loc.pool.get_value_buffer(loc.local_layer_id)

    def layer_info(self, layer_id: int) -> dict[str, Any]:
        """One LayerInfo (http_api.md §6): kind, which buffers exist, where, their shapes, bytes/token."""
        kind = self.layer_kind(layer_id)
        routes = self._routes[layer_id]
        return {
            "layer_id": layer_id,
            "attention": "dense" if kind == DENSE else "sparse",
            "kind": kind,
            "buffers": {b: routes[b] is not None for b in BUFFER_NAMES},
            "locations": {
                b: None
                if (r := routes[b]) is None
                else {"pool": r.pool.name, "local_layer_id": r.local_layer_id}
                for b in BUFFER_NAMES
            },
            "shapes": {
                b: None if (r := routes[b]) is None else list(r.pool.buffer_shape) for b in BUFFER_NAMES
            },
            "bytes_per_token": self.layer_bytes_per_token(layer_id),
        }

    def layers_info(self) -> list[dict[str, Any]]:
        return [self.layer_info(i) for i in range(self.num_layers)]

    def buffer_info(self, layer_id: int, buffer: str) -> dict[str, Any]:
        """Metadata of one real buffer; `MissingBufferError` (says why, what to use) if the layer lacks it."""
        loc = self.buffer_location(layer_id, buffer)
        if loc is None:
            raise self._missing_buffer_error(layer_id, buffer)
        t = self._buffer_tensor(loc, buffer)
        return {
            "layer_id": layer_id,
            "buffer": buffer,
            "pool": loc.pool.name,
            "pool_class": type(loc.pool).__name__,
            "local_layer_id": loc.local_layer_id,
            "shape": list(t.shape),
            "dtype": dtype_name(t.dtype),
            "bytes": t.numel() * t.element_size(),
        }

    def sub_pools_info(self) -> list[dict[str, Any]]:
        return [
            {
                "name": p.name,
                "class": type(p).__name__,
                "layer_ids": list(p.global_layer_ids),
                "head_num": p.head_num,
                "head_dim": p.head_dim,
                "has_key": True,
                "has_value": p.has_value_buffer,
                "bytes": p.total_bytes(),
            }
            for p in self.sub_pools()
        ]

    def _missing_buffer_error(self, layer_id: int, buffer: str) -> MissingBufferError:
        kind = self.layer_kinds[layer_id]
        owners = self.layers_with(buffer)
        tail = (
            f"only layers {owners} have '{buffer}'." if owners else f"no layer of this model has '{buffer}'."
        )
        if kind == SPARSE_K_ONLY:  # the only buffer a K-only layer lacks is index_value
            msg = (
                f"layer {layer_id} is a score-only sparse layer (sparse_disable_index_value): its index K "
                "lives in MHATokenToKOnlyPool, which does not allocate V. Use buffer 'index_key' for the "
                f"index keys; {tail}"
            )
        elif kind == DENSE:
            msg = (
                f"layer {layer_id} is a dense layer: it has no indexer, so it has only buffers 'key' and "
                f"'value' (in {self.main_pool.name}). Use buffer 'key' / 'value' for its attention K/V; {tail}"
            )
        else:  # NOTE: unreachable while KIND_BUFFERS gives sparse_index_kv every buffer
            msg = f"layer {layer_id} ({kind}) has no buffer '{buffer}'; {tail}"
        return MissingBufferError(msg, layer_id, buffer)
