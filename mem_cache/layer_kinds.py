"""Layer kinds, buffer names, routing records and the per-token element formula (model.md §5): no tensors."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from types import MappingProxyType

from mem_cache.kv_pool import MHATokenToKOnlyPool, MHATokenToKVPool

DENSE = "dense"
SPARSE_INDEX_KV = "sparse_index_kv"
SPARSE_K_ONLY = "sparse_k_only"
LAYER_KINDS: tuple[str, ...] = (DENSE, SPARSE_INDEX_KV, SPARSE_K_ONLY)

# Buffer names used by the introspection API and GET /pools/layers (http_api.md §6).
BUFFER_NAMES: tuple[str, ...] = ("key", "value", "index_key", "index_value")

# Which buffers each layer kind has.
KIND_BUFFERS: MappingProxyType[str, frozenset[str]] = MappingProxyType(
    {
        DENSE: frozenset({"key", "value"}),
        SPARSE_INDEX_KV: frozenset({"key", "value", "index_key", "index_value"}),
        SPARSE_K_ONLY: frozenset({"key", "value", "index_key"}),
    }
)


@dataclass(frozen=True)
class BufferLocation:
    """Where one buffer of one global layer lives: a sub-pool and the local layer id inside it."""

    pool: MHATokenToKVPool | MHATokenToKOnlyPool
    local_layer_id: int


def validate_layer_kinds(layer_kinds: Sequence[str]) -> tuple[str, ...]:
    """Return `layer_kinds` as a tuple; an unknown kind or an empty list -> ValueError naming it."""
    kinds = tuple(layer_kinds)
    if not kinds:
        raise ValueError("layer_kinds is empty: a pool needs at least one layer")
    for i, kind in enumerate(kinds):
        if kind not in LAYER_KINDS:
            raise ValueError(f"layer_kinds[{i}] = {kind!r} is not one of {list(LAYER_KINDS)}")
    return kinds


def check_buffer_name(buffer: str) -> None:
    if buffer not in BUFFER_NAMES:
        raise ValueError(f"unknown buffer {buffer!r}; valid buffer names are {list(BUFFER_NAMES)}")


def elements_per_token(kind: str, head_num: int, head_dim: int, index_head_dim: int) -> int:
    """Cached elements per token for ONE layer of `kind` (model.md §5): main K and V, and its index buffers."""
    if kind not in KIND_BUFFERS:
        raise ValueError(f"unknown layer kind {kind!r}; valid kinds are {list(LAYER_KINDS)}")
    return 2 * head_num * head_dim + index_head_dim * len(KIND_BUFFERS[kind] - {"key", "value"})
