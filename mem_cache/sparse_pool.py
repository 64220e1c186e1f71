"""`MiniMaxSparseKVPool`: the parent KV pool every caller talks to (main + index-KV + index-K-only)."""

from collections.abc import Sequence

import torch

from mem_cache import pool_info
from mem_cache.kv_pool import MHATokenToKOnlyPool, MHATokenToKVPool


class MiniMaxSparseKVPool(pool_info.SparsePoolInfoMixin):
    """Token-slot KV cache for a model mixing dense and block-sparse attention layers, over sub-pools that share
    its token slots (`size + 1` rows each, row 0 the padding slot):
    - `main_pool` (MHATokenToKVPool, head_num x head_dim): main K/V of EVERY layer, local id == global id.
    - `index_kv_pool` (MHATokenToKVPool, 1 x index_head_dim): index K and V of the `sparse_index_kv` layers.
    - `index_k_pool` (MHATokenToKOnlyPool, 1 x index_head_dim): index K of the `sparse_k_only` layers.
    (None where the model has no such layer.) Every accessor takes a GLOBAL layer id and routes to the sub-pool
    that owns the buffer; an index accessor for a layer outside its group raises `ValueError` naming the valid
    layers (generic code asks `has_buffer` / `has_index_value_buffer` / `layer_info` first)."""

    page_size = 1  # reported by GET /pools; SGLang serves CPU with page size 1, and so do we

    def __init__(self, size: int, dtype: torch.dtype, layer_kinds: Sequence[str], head_num: int, head_dim: int,
                 index_head_dim: int, device: str | torch.device = "cpu") -> None:
        self.layer_kinds = pool_info.validate_layer_kinds(layer_kinds)
        self.num_layers, self.size, self.dtype, self.device = len(self.layer_kinds), size, dtype, torch.device(device)
        self.head_num, self.head_dim, self.index_head_dim = head_num, head_dim, index_head_dim
        self.main_pool = MHATokenToKVPool(size, dtype, head_num, head_dim, self.num_layers, self.device, "main_pool")

        def index_pool(cls: type[MHATokenToKVPool], kind: str, name: str) -> MHATokenToKVPool | None:
            ids = [i for i, k in enumerate(self.layer_kinds) if k == kind]
            return cls(size, dtype, 1, index_head_dim, len(ids), self.device, name, ids) if ids else None

        self.index_kv_pool = index_pool(MHATokenToKVPool, pool_info.SPARSE_INDEX_KV, "index_kv_pool")
        self.index_k_pool = index_pool(MHATokenToKOnlyPool, pool_info.SPARSE_K_ONLY, "index_k_pool")
        # NOTE: _routes alone says which buffer of which layer lives where: all accessors and introspection use it.
        self._routes = [dict.fromkeys(pool_info.BUFFER_NAMES) for _ in self.layer_kinds]
        for pool, names in ((self.main_pool, ("key", "value")), (self.index_kv_pool, ("index_key", "index_value")),
                            (self.index_k_pool, ("index_key",))):
            for local, layer in enumerate(pool.global_layer_ids if pool is not None else []):
                self._routes[layer] |= dict.fromkeys(names, pool_info.BufferLocation(pool, local))

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.main_pool.get_key_buffer(layer_id)

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.main_pool.get_value_buffer(layer_id)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.main_pool.get_kv_buffer(layer_id)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        self.main_pool.set_kv_buffer(layer_id, loc, cache_k, cache_v)

    def _index_route(self, layer_id: int, buffer: str, accessor: str) -> pool_info.BufferLocation:
        if (loc := self.buffer_location(layer_id, buffer)) is not None:
            return loc
        owners, what = self.layers_with(buffer), f"an index {buffer.removeprefix('index_')} buffer"
        if self.layer_kinds[layer_id] == pool_info.DENSE:
            why, instead = "dense (no indexer, no index buffers)", f"get_kv_buffer({layer_id}) for its main K/V"
        else:
            why = "sparse_k_only (score-only sparse layer, sparse_disable_index_value set: no index V is stored)"
            instead = f"get_index_k_buffer({layer_id}) for its index keys"
        have = f"only layers {owners} have {what}" if owners else f"no layer of this model has {what}"
        raise ValueError(f"{accessor}: layer {layer_id} is {why}; {have}. Use {instead}.")

    def get_index_k_buffer(self, layer_id: int) -> torch.Tensor:
        r = self._index_route(layer_id, "index_key", "get_index_k_buffer")
        return r.pool.get_key_buffer(r.local_layer_id)

    def set_index_k_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor) -> None:
        r = self._index_route(layer_id, "index_key", "set_index_k_buffer")
        r.pool.set_k_buffer(r.local_layer_id, loc, cache_k)

    def get_index_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self._index_route(layer_id, "index_value", "get_index_kv_buffer")
        return r.pool.get_kv_buffer(r.local_layer_id)

    def get_index_v_buffer(self, layer_id: int) -> torch.Tensor:
        r = self._index_route(layer_id, "index_value", "get_index_v_buffer")
        return r.pool.get_value_buffer(r.local_layer_id)

    def set_index_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor
                            ) -> None:
        r = self._index_route(layer_id, "index_value", "set_index_kv_buffer")
        r.pool.set_kv_buffer(r.local_layer_id, loc, cache_k, cache_v)

    @staticmethod
    def bytes_per_token_for(layer_kinds: Sequence[str], head_num: int, head_dim: int, index_head_dim: int,
                            dtype: torch.dtype) -> int:
        """Bytes one token slot costs over all layers and buffers (model.md §5 times element size)."""
        kinds = pool_info.validate_layer_kinds(layer_kinds)
        return dtype.itemsize * sum(pool_info.elements_per_token(k, head_num, head_dim, index_head_dim) for k in kinds)

    @classmethod
    def size_for_budget(cls, budget_bytes: int, layer_kinds: Sequence[str], head_num: int, head_dim: int,
                        index_head_dim: int, dtype: torch.dtype) -> int:
        """Largest `size` whose pool, padding slot included, fits `budget_bytes`."""
        per_token = cls.bytes_per_token_for(layer_kinds, head_num, head_dim, index_head_dim, dtype)
        size = budget_bytes // per_token - 1  # NOTE: the pool holds size + 1 rows (row 0 is the padding slot)
        if size < 1:
            raise ValueError(f"a KV budget of {budget_bytes} bytes holds no usable slot: one token costs {per_token} "
                             f"bytes and at least 2 rows ({2 * per_token} bytes) are needed")
        return size

    def bytes_per_token(self) -> int:
        return self.bytes_per_token_for(self.layer_kinds, self.head_num, self.head_dim, self.index_head_dim, self.dtype)

    def bytes_per_token_by_kind(self) -> dict[str, int]:
        """Bytes per token of ONE layer of each kind present in this model (in LAYER_KINDS order)."""
        first = {k: self.layer_kinds.index(k) for k in pool_info.LAYER_KINDS if k in self.layer_kinds}
        return {k: self.layer_bytes_per_token(i) for k, i in first.items()}

    def total_bytes(self) -> int:
        return sum(p.total_bytes() for p in self.sub_pools())
