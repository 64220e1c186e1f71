"""Per-layer token-slot KV buffers: a K+V pool and a K-only pool (SGLang's `MHATokenToKVPool` style)."""

import torch

from mem_cache.errors import KOnlyPoolError, LayerIdError


def check_layer_id(layer_id: int, num_layers: int, where: str = "", global_ids: list[int] | None = None) -> None:
    if 0 <= layer_id < num_layers:
        return
    if global_ids is None or global_ids == list(range(num_layers)):
        raise LayerIdError(f"{where}layer_id {layer_id} does not exist; valid layer ids are 0..{num_layers - 1}")
    raise LayerIdError(f"{where}local layer id {layer_id} is out of range [0, {num_layers}) (this pool holds "
                       f"global layers {global_ids})")


class MHATokenToKVPool:
    """Per local layer a K and (`has_value_buffer`) a V buffer `[size + 1, head_num, head_dim]`, zeroed, row 0 the
    padding slot. `layer_id` arguments are LOCAL ids; `global_layer_ids[local]` is the model layer."""

    has_value_buffer: bool = True

    def __init__(self, size: int, dtype: torch.dtype, head_num: int, head_dim: int, layer_num: int,
                 device: str | torch.device = "cpu", name: str = "main_pool",
                 global_layer_ids: list[int] | None = None) -> None:
        cls = type(self).__name__
        if min(size, head_num, head_dim, layer_num) <= 0:
            raise ValueError(f"{cls} '{name}': size, head_num, head_dim and layer_num must be positive, got "
                             f"{size}, {head_num}, {head_dim}, {layer_num}")
        ids = list(range(layer_num)) if global_layer_ids is None else list(global_layer_ids)
        if len(ids) != layer_num:
            raise ValueError(f"{cls} '{name}': {len(ids)} global_layer_ids given for layer_num={layer_num}")
        self.size, self.dtype, self.device, self.name = size, dtype, torch.device(device), name
        self.head_num, self.head_dim, self.layer_num, self.global_layer_ids = head_num, head_dim, layer_num, ids
        self.buffer_shape = (size + 1, head_num, head_dim)
        self.k_buffer = [torch.zeros(self.buffer_shape, dtype=dtype, device=self.device) for _ in range(layer_num)]
        if self.has_value_buffer:
            self.v_buffer = [torch.zeros(self.buffer_shape, dtype=dtype, device=self.device) for _ in range(layer_num)]

    def check_layer(self, layer_id: int) -> None:
        check_layer_id(layer_id, self.layer_num, f"{type(self).__name__} '{self.name}': ", self.global_layer_ids)

    def _rows(self, loc: torch.Tensor, data: torch.Tensor, what: str) -> torch.Tensor:
        """`data` as `[len(loc), head_num, head_dim]` in the pool dtype."""
        if data.numel() != loc.numel() * self.head_num * self.head_dim:
            raise ValueError(f"{type(self).__name__} '{self.name}': {what} of shape {tuple(data.shape)} does not "
                             f"fit {loc.numel()} slots x [{self.head_num}, {self.head_dim}]")
        return data.reshape(-1, self.head_num, self.head_dim).to(self.dtype)

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        self.check_layer(layer_id)
        return self.k_buffer[layer_id]

    def set_k_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor) -> None:
        """Write K rows `loc` of local layer `layer_id` (cast to the pool dtype), in place."""
        self.check_layer(layer_id)
        self.k_buffer[layer_id].index_copy_(0, loc, self._rows(loc, cache_k, "cache_k"))

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        self.check_layer(layer_id)
        return self.v_buffer[layer_id]

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.get_key_buffer(layer_id), self.v_buffer[layer_id]

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        """Write K and V rows `loc` of local layer `layer_id` (cast to the pool dtype), in place."""
        v = self._rows(loc, cache_v, "cache_v")  # (checked here, K in set_k_buffer: both before either is written)
        self.set_k_buffer(layer_id, loc, cache_k)
        self.v_buffer[layer_id].index_copy_(0, loc, v)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.k_buffer, *getattr(self, "v_buffer", [])]

    def bytes_per_token(self) -> int:
        per_layer = (2 if self.has_value_buffer else 1) * self.head_num * self.head_dim
        return self.layer_num * per_layer * self.dtype.itemsize

    def total_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


class MHATokenToKOnlyPool(MHATokenToKVPool):
    """Per local layer a K buffer only: index keys of score-only sparse layers (`sparse_disable_index_value`: V is never
    read or allocated). V accessors raise `KOnlyPoolError`; generic code checks `has_value_buffer`."""

    has_value_buffer: bool = False

    def _no_value(self, accessor: str, layer_id: int) -> KOnlyPoolError:
        self.check_layer(layer_id)
        gid = self.global_layer_ids[layer_id]
        return KOnlyPoolError(
            f"{accessor}: global layer {gid} (local layer {layer_id} of MHATokenToKOnlyPool '{self.name}') has no V "
            "buffer: MHATokenToKOnlyPool stores no V by design, its layers are score-only sparse layers "
            f"(sparse_disable_index_value set) whose index value is never read. Use get_key_buffer({layer_id}) on "
            f"this pool, or get_index_k_buffer({gid}) on the parent MiniMaxSparseKVPool, for the index keys; check "
            "has_value_buffer / MiniMaxSparseKVPool.has_index_value_buffer(layer_id) before asking for V.")

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        raise self._no_value("get_value_buffer", layer_id)

    def get_kv_buffer(self, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise self._no_value("get_kv_buffer", layer_id)

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> None:
        raise self._no_value("set_kv_buffer", layer_id)
