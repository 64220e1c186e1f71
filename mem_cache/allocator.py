"""Token-slot allocator: a free list of KV-cache slots, page-granular when page_size > 1."""

from __future__ import annotations

import torch

from mem_cache.errors import PoolExhaustedError


class TokenSlotAllocator:
    """Hands out token slots of the KV pools; a slot addresses one token in every buffer of every layer.

    Layout (SGLang convention): the KV buffers have `size + page_size` rows. Page 0 (slots
    `0 .. page_size-1`) is the padding page: it is never handed out, so dummy/padded writes can
    target slot 0 without corrupting anyone. Pages `1 .. size // page_size` are allocatable; page `p`
    owns slots `p*page_size .. p*page_size + page_size - 1`. With page_size == 1 this is simply
    "slots 1..size".

    Paging semantics (kept deliberately simple):
    - `alloc(n)` takes `ceil(n / page_size)` whole pages and returns the slots of the first `n`
      positions (int64, on `device`). The unused tail of the last page stays owned by the caller
      (a caller may fill it later with `slot + 1` as long as it stays inside the page).
    - `free(slots)` frees every page that any of the given slots belongs to; a page is freed once
      even if several of its slots are given. Freeing a page that is not allocated, a slot given
      twice, or a slot outside the allocatable range raises `ValueError` naming the slot, and
      leaves the allocator untouched.
    """

    def __init__(self, size: int, page_size: int = 1, device: str | torch.device = "cpu") -> None:
        if page_size <= 0:
            raise ValueError(f"TokenSlotAllocator: page_size must be >= 1, got {page_size}")
        if size <= 0 or size % page_size != 0:
            raise ValueError(
                f"TokenSlotAllocator: size must be a positive multiple of page_size ({page_size}), got {size}"
            )
        self.size = size
        self.page_size = page_size
        self.num_pages = size // page_size
        self.device = torch.device(device)
        # NOTE: index = page id; entry 0 (padding page) is always False and never appears in the free list.
        self._allocated = torch.zeros(self.num_pages + 1, dtype=torch.bool, device=self.device)
        self._free_pages = torch.empty(0, dtype=torch.int64, device=self.device)
        self._page_offsets = torch.arange(page_size, dtype=torch.int64, device=self.device)
        self.clear()

    def available_size(self) -> int:
        """Free token slots (whole free pages times page_size)."""
        return self._free_pages.numel() * self.page_size

    def used_size(self) -> int:
        return self.size - self.available_size()

    def pages_needed(self, n: int) -> int:
        return -(-n // self.page_size)

    def can_alloc(self, n: int) -> bool:
        return n >= 0 and self.pages_needed(n) <= self._free_pages.numel()

    def alloc(self, n: int) -> torch.Tensor:
        """Allocate slots for `n` tokens (whole pages); returns an int64 tensor of `n` slots."""
        if n < 0:
            raise ValueError(f"TokenSlotAllocator.alloc: n must be >= 0, got {n}")
        need = self.pages_needed(n)
        if need > self._free_pages.numel():
            raise PoolExhaustedError(
                f"TokenSlotAllocator: asked for {n} token slots ({need} pages of {self.page_size}) but only "
                f"{self.available_size()} of {self.size} are free (call can_alloc() first; evict or retract)"
            )
        pages, self._free_pages = self._free_pages[:need], self._free_pages[need:]
        self._allocated[pages] = True
        slots = (pages[:, None] * self.page_size + self._page_offsets[None, :]).reshape(-1)
        return slots[:n]

    def free(self, slots: torch.Tensor) -> None:
        """Free the pages owning `slots` (any integer tensor); see the class docstring."""
        slots = slots.reshape(-1).to(device=self.device, dtype=torch.int64)
        if slots.numel() == 0:
            return
        lo, hi = self.page_size, (self.num_pages + 1) * self.page_size
        bad = (slots < lo) | (slots >= hi)
        if bool(bad.any()):
            slot = int(slots[bad][0])
            raise ValueError(
                f"TokenSlotAllocator.free: slot {slot} is outside the allocatable range [{lo}, {hi})"
                + (" (it is in the reserved padding page)" if 0 <= slot < lo else "")
            )
        uniq, counts = torch.unique(slots, return_counts=True)
        if bool((counts > 1).any()):
            raise ValueError(
                f"TokenSlotAllocator.free: slot {int(uniq[counts > 1][0])} given twice (double free)"
            )
        slot_pages = slots // self.page_size
        not_owned = ~self._allocated[slot_pages]
        if bool(not_owned.any()):
            slot = int(slots[not_owned][0])
            raise ValueError(
                f"TokenSlotAllocator.free: slot {slot} (page {slot // self.page_size}) is not allocated "
                "(double free?)"
            )
        pages = torch.unique(slot_pages)
        self._allocated[pages] = False
        # NOTE: the free list stays sorted, so a request's slots come out consecutive whenever the
        # pool allows it, and attention can then read them as a view instead of gathering.
        self._free_pages = torch.sort(torch.cat([self._free_pages, pages])).values

    def clear(self) -> None:
        """Free every slot."""
        self._allocated.zero_()
        self._free_pages = torch.arange(1, self.num_pages + 1, dtype=torch.int64, device=self.device)

    def check_integrity(self) -> bool:
        """No duplicate or out-of-range free pages, none both free and allocated, free + used == size."""
        free = self._free_pages
        assert torch.unique(free).numel() == free.numel(), (
            "TokenSlotAllocator: free list holds duplicate pages"
        )
        if free.numel():
            assert int(free.min()) >= 1 and int(free.max()) <= self.num_pages, (
                f"TokenSlotAllocator: free list holds pages outside [1, {self.num_pages}]"
            )
        assert not bool(self._allocated[0]), "TokenSlotAllocator: padding page 0 is marked allocated"
        both = free[self._allocated[free]]
        assert both.numel() == 0, f"TokenSlotAllocator: pages {both[:8].tolist()} are both free and allocated"
        used_pages = int(self._allocated.sum())
        assert (used_pages + free.numel()) == self.num_pages, (
            f"TokenSlotAllocator: free ({free.numel()}) + used ({used_pages}) pages != {self.num_pages}"
        )
        return True
