"""Per-layer token-slot KV buffers: a K+V pool and a K-only pool (SGLang `MHATokenToKVPool` style)."""

from __future__ import annotations

import torch

from mem_cache.errors import KOnlyPoolError, LayerIdError

__all__ = ["KOnlyPoolError", "MHATokenToKVPool", "MHATokenToKOnlyPool"]


class _MHAPoolBase:
    """Shared part of both pools: per-local-layer K buffers `[size + page_size, head_num, head_dim]`.

    `layer_id` arguments are LOCAL ids (0..layer_num-1); `global_layer_ids[local]` is the model layer.
    """

    has_value_buffer: bool
    buffers_per_layer: int  # 2 for K+V, 1 for K only

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device = "cpu",
        name: str = "main_pool",
        global_layer_ids: list[int] | None = None,
    ) -> None:
        cls = type(self).__name__
        if size <= 0 or page_size <= 0 or head_num <= 0 or head_dim <= 0 or layer_num <= 0:
            raise ValueError(
                f"{cls} '{name}': size, page_size, head_num, head_dim and layer_num must be positive, got "
                f"{size}, {page_size}, {head_num}, {head_dim}, {layer_num}"
            )
        ids = list(range(layer_num)) if global_layer_ids is None else list(global_layer_ids)
        if len(ids) != layer_num:
            raise ValueError(f"{cls} '{name}': {len(ids)} global_layer_ids given for layer_num={layer_num}")
        self.size = size
        self.page_size = page_size
        self.dtype = dtype
        self.head_num = head_num
        self.head_dim = head_dim
        self.layer_num = layer_num
        self.device = torch.device(device)
        self.name = name
        self.global_layer_ids = ids
        # NOTE: rows 0..page_size-1 are the padding page (dummy writes); real slots start at page_size.
        self.k_buffer = [self._new_buffer() for _ in range(layer_num)]

    @property
    def buffer_shape(self) -> tuple[int, int, int]:
        return (self.size + self.page_size, self.head_num, self.head_dim)

    def _new_buffer(self) -> torch.Tensor:
        return torch.zeros(self.buffer_shape, dtype=self.dtype, device=self.device)

    def _check_layer(self, layer_id: int) -> None:
        if not 0 <= layer_id < self.layer_num:
            raise LayerIdError(
                f"{type(self).__name__} '{self.name}': local layer id {layer_id} is out of range "
                f"[0, {self.layer_num}) (this pool holds global layers {self.global_layer_ids})"
            )

    def _rows(self, loc: torch.Tensor, data: torch.Tensor, what: str) -> torch.Tensor:
        """`data` reshaped to `[len(loc), head_num, head_dim]` and cast to the pool dtype."""
        if data.numel() != loc.numel() * self.head_num * self.head_dim:
            raise ValueError(
                f"{type(self).__name__} '{self.name}': {what} of shape {tuple(data.shape)} does not fit "
                f"{loc.numel()} slots x [{self.head_num}, {self.head_dim}]"
            )
        rows = data.reshape(-1, self.head_num, self.head_dim)
        return rows if rows.dtype == self.dtype else rows.to(self.dtype)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        self._check_layer(layer_id)
        return self.k_buffer[layer_id]

    def set_k_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor) -> None:
        """Write K rows `loc` of local layer `layer_id` (cast to the pool dtype)."""
        self._check_layer(layer_id)
        self.k_buffer[layer_id].index_copy_(0, loc, self._rows(loc, cache_k, "cache_k"))

    def _tensors(self) -> list[torch.Tensor]:
        return list(self.k_buffer)

    def bytes_per_token(self) -> int:
        """Bytes one token slot costs across all layers of this pool."""
        return self.layer_num * self.buffers_per_layer * self.head_num * self.head_dim * self.dtype.itemsize

    def total_bytes(self) -> int:
        """Real allocated bytes: sum of numel * element_size over every tensor this pool holds."""
        return sum(t.numel() * t.element_size() for t in self._tensors())


class MHATokenToKVPool(_MHAPoolBase):
    """Per local layer a K and a V buffer, each `[size + page_size, head_num, head_dim]`, zero-initialised."""

    has_value_buffer: bool = True
    buffers_per_layer: int = 2

    def __init__(
        self,
        size: int,
        page_size: int,
        dtype: torch.dtype,
        head_num: int,
        head_dim: int,
        layer_num: int,
        device: str | torch.device = "cpu",
        name: str = "main_pool",
        global_layer_ids: list[int] | None = None,
    ) -> None:
        super().__init__(
            size, page_size, dtype, head_num, head_dim, layer_num, device, name, global_layer_ids
        )
        self.v_buffer = [self._new_buffer() for _ in range(layer_num)]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        self._check_layer(layer_id)
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        self._check_layer(layer_id)
        return self.k_buffer[layer_id], self.v_buffer[layer_id]

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> None:
        """Write K and V rows `loc` of local layer `layer_id` (cast to the pool dtype)."""
        self._check_layer(layer_id)
        self.k_buffer[layer_id].index_copy_(0, loc, self._rows(loc, cache_k, "cache_k"))
        self.v_buffer[layer_id].index_copy_(0, loc, self._rows(loc, cache_v, "cache_v"))

    def _tensors(self) -> list[torch.Tensor]:
        return [*self.k_buffer, *self.v_buffer]


class MHATokenToKOnlyPool(_MHAPoolBase):
    """Per local layer only a K buffer; holds the index keys of score-only sparse layers.

    Its layers have `sparse_disable_index_value` set: the indexer only scores, V is never read, so
    no V tensor is ever allocated. Every V accessor raises `KOnlyPoolError` (a NotImplementedError)
    whose message names the layer and the accessor to use instead. Generic code should check
    `has_value_buffer` (False here) instead of catching it.
    """

    has_value_buffer: bool = False
    buffers_per_layer: int = 1

    def _no_value(self, accessor: str, layer_id: int) -> KOnlyPoolError:
        self._check_layer(layer_id)
        gid = self.global_layer_ids[layer_id]
        return KOnlyPoolError(
            f"{accessor}: global layer {gid} (local layer {layer_id} of MHATokenToKOnlyPool '{self.name}') "
            "has no V buffer: MHATokenToKOnlyPool stores no V by design, its layers are score-only sparse "
            "layers (sparse_disable_index_value set) whose index value is never read. Use "
            f"get_key_buffer({layer_id}) on this pool, or get_index_k_buffer({gid}) on the parent "
            "MiniMaxSparseKVPool, for the index keys; check has_value_buffer / "
            "MiniMaxSparseKVPool.has_index_value_buffer(layer_id) before asking for V."
        )

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        raise self._no_value("get_value_buffer", layer_id)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise self._no_value("get_kv_buffer", layer_id)

    def set_kv_buffer(
        self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor
    ) -> None:
        raise self._no_value("set_kv_buffer", layer_id)
