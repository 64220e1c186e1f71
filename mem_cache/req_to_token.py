"""Request-slot pool: a table mapping (request slot, position) -> token slot index."""

from __future__ import annotations

import torch

from mem_cache.errors import PoolExhaustedError


class ReqToTokenPool:
    """A `[size, max_context_len]` int32 table; row = request slot, column = position -> token slot.

    Attention reads a request's K/V by gathering the pool buffers at `req_to_token[row, :seq_len]`.
    Request slots come from a free list; pair `can_alloc(n)` with `alloc(n)` so callers never
    half-allocate. `free` is all-or-nothing: a bad index leaves the pool untouched.
    """

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(f"ReqToTokenPool needs size > 0 and max_context_len > 0, got {size} and {max_context_len}")
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self._free: list[int] = []
        self._in_use: list[bool] = []
        self.clear()

    def available_size(self) -> int:
        return len(self._free)

    def used_size(self) -> int:
        return self.size - len(self._free)

    def can_alloc(self, n: int) -> bool:
        return 0 <= n <= len(self._free)

    def alloc(self, n: int) -> list[int]:
        """Take `n` request slots. Raises `PoolExhaustedError` if fewer than `n` are free."""
        if n < 0:
            raise ValueError(f"ReqToTokenPool.alloc: n must be >= 0, got {n}")
        if n > len(self._free):
            raise PoolExhaustedError(f"ReqToTokenPool: asked for {n} request slots but only {len(self._free)} of "
                                     f"{self.size} are free (raise --max-running-requests or wait for requests to "
                                     "finish; call can_alloc() first)")
        taken, self._free = self._free[:n], self._free[n:]
        for idx in taken:
            self._in_use[idx] = True
        return taken

    def free(self, idx: int | list[int]) -> None:
        """Return request slots. Out-of-range, duplicate or not-allocated indices -> `ValueError`."""
        indices = [idx] if isinstance(idx, int) else list(idx)
        seen: set[int] = set()
        for i in indices:
            if not 0 <= i < self.size:
                raise ValueError(f"ReqToTokenPool.free: request slot {i} is out of range [0, {self.size})")
            if not self._in_use[i] or i in seen:
                raise ValueError(f"ReqToTokenPool.free: request slot {i} is not allocated (double free?)")
            seen.add(i)
        for i in indices:
            self._in_use[i] = False
        self._free.extend(indices)

    def write(self, req_idx: int, start: int, slots: torch.Tensor) -> None:
        """Set `req_to_token[req_idx, start:start + len(slots)] = slots`."""
        end = start + slots.numel()
        if not 0 <= req_idx < self.size:
            raise ValueError(f"ReqToTokenPool.write: request slot {req_idx} is out of range [0, {self.size})")
        if start < 0 or end > self.max_context_len:
            raise ValueError(f"ReqToTokenPool.write: positions [{start}, {end}) exceed max_context_len "
                             f"{self.max_context_len}")
        self.req_to_token[req_idx, start:end] = slots.reshape(-1).to(self.req_to_token)

    def clear(self) -> None:
        """Free every request slot (table contents are left as they are; rows are rewritten on use)."""
        self._free = list(range(self.size))
        self._in_use = [False] * self.size

    def check_integrity(self) -> bool:
        """Free list has no duplicates, agrees with the in-use flags, and free + used == size."""
        free_set = set(self._free)
        assert len(free_set) == len(self._free), "ReqToTokenPool: free list holds duplicate request slots"
        assert all(0 <= i < self.size for i in free_set), "ReqToTokenPool: free list holds out-of-range slots"
        both = [i for i in free_set if self._in_use[i]]
        assert not both, f"ReqToTokenPool: request slots {both[:8]} are both free and in use"
        used = sum(self._in_use)
        assert used + len(self._free) == self.size, (
            f"ReqToTokenPool: free ({len(self._free)}) + used ({used}) != size ({self.size})")
        return True
