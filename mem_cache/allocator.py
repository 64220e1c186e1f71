"""Token-slot allocator: the free list of KV-cache slots."""

import torch

from mem_cache.errors import PoolExhaustedError


class TokenSlotAllocator:
    """Hands out token slots `1 .. size` of the KV pools (a slot addresses one token in every buffer of every layer).
    NOTE: the buffers have `size + 1` rows (SGLang's layout, page size 1); slot 0, the padding slot, is never handed
    out, so padded writes (a decode graph's unused rows) can target it without corrupting anyone."""

    def __init__(self, size: int, device: str | torch.device = "cpu", keep_sorted: bool = True) -> None:
        if size <= 0:
            raise ValueError(f"TokenSlotAllocator: size must be positive, got {size}")
        self.size, self.device, self.keep_sorted = size, torch.device(device), keep_sorted
        self._allocated = torch.zeros(size + 1, dtype=torch.bool, device=self.device)  # (index = slot; 0 always False)
        self.clear()  # (sets the free list)

    def available_size(self) -> int:
        return self._free.numel()

    def used_size(self) -> int:
        return self.size - self.available_size()

    def can_alloc(self, n: int) -> bool:
        return 0 <= n <= self._free.numel()

    def alloc(self, n: int) -> torch.Tensor:
        """Take `n` slots (int64, on `device`); `PoolExhaustedError` when fewer are free."""
        if n < 0:
            raise ValueError(f"TokenSlotAllocator.alloc: n must be >= 0, got {n}")
        if n > self._free.numel():
            raise PoolExhaustedError(f"TokenSlotAllocator: asked for {n} token slots but only {self._free.numel()} of "
                                     f"{self.size} are free (call can_alloc() first; evict or retract)")
        slots, self._free = self._free[:n], self._free[n:]
        self._allocated[slots] = True
        return slots

    def free(self, slots: torch.Tensor, checked: bool = True) -> None:
        """Give `slots` (any integer tensor) back; a slot outside `1 .. size`, given twice or not allocated is
        refused by name, leaving the allocator untouched. `checked=False` (the prefix tree's evictions: its own
        distinct slots): no checks, which read on the host (on a GPU, a sync at every step a full pool evicts)."""
        slots = slots.reshape(-1).to(device=self.device, dtype=torch.int64)
        if slots.numel() == 0:
            return
        if checked:
            if bool((bad := (slots < 1) | (slots > self.size)).any()):
                slot = int(slots[bad][0])
                raise ValueError(f"TokenSlotAllocator.free: slot {slot} is outside the allocatable range "
                                 f"[1, {self.size}]" + (" (it is the reserved padding slot)" if slot == 0 else ""))
            uniq, counts = torch.unique(slots, return_counts=True)
            if bool((counts > 1).any()):
                raise ValueError(f"TokenSlotAllocator.free: slot {int(uniq[counts > 1][0])} given twice (double free)")
            if bool((not_owned := ~self._allocated[slots]).any()):
                raise ValueError(f"TokenSlotAllocator.free: slot {int(slots[not_owned][0])} is not allocated "
                                 "(double free?)")
        self._allocated[slots] = False
        # NOTE: the free list stays sorted, so a request's slots come out consecutive when the pool allows, and a long
        # prefill reads its K/V as a view, not a gather (a host tier's slots, only copied, skip the sort).
        free = torch.cat([self._free, slots])
        self._free = torch.sort(free).values if self.keep_sorted else free

    def is_allocated(self, slots: torch.Tensor) -> bool:
        slots = slots.reshape(-1).to(device=self.device, dtype=torch.int64)
        return bool(((slots >= 1) & (slots <= self.size)).all()) and bool(self._allocated[slots].all())

    def clear(self) -> None:
        self._allocated.zero_()
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)

    def check_integrity(self) -> bool:
        free = self._free
        assert torch.unique(free).numel() == free.numel(), "TokenSlotAllocator: free list holds duplicate slots"
        assert bool(((free >= 1) & (free <= self.size)).all()), (
            f"TokenSlotAllocator: free list holds slots outside [1, {self.size}]")
        assert not bool(self._allocated[0]), "TokenSlotAllocator: padding slot 0 is marked allocated"
        both = free[self._allocated[free]]
        assert both.numel() == 0, f"TokenSlotAllocator: slots {both[:8].tolist()} are both free and allocated"
        used = int(self._allocated.sum())
        assert used + free.numel() == self.size, (
            f"TokenSlotAllocator: free ({free.numel()}) + used ({used}) slots != {self.size}")
        return True
