"""KVCacheManager: the one owner of token slots, request rows (`ReqToTokenPool`) and the prefix cache; every
allocatable slot is, at any time, exactly one of: free (in the allocator), held by the radix tree, or owned by one
live request. The scheduler asks (`can_admit`, `can_allocate`) then acts (`admit`, `allocate`, `release`)."""

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from mem_cache.allocator import TokenSlotAllocator
from mem_cache.errors import PoolExhaustedError
from mem_cache.hicache import HiCache
from mem_cache.radix_cache import RadixCache, TreeNode


class ReqToTokenPool:
    """A `[size, max_context_len]` int32 table, request slot (row) and position -> token slot: attention gathers a
    request's K/V at `req_to_token[row, :seq_len]`. Rows come from a free list."""

    def __init__(self, size: int, max_context_len: int, device: str | torch.device = "cpu") -> None:
        if size <= 0 or max_context_len <= 0:
            raise ValueError(f"ReqToTokenPool needs size > 0 and max_context_len > 0, got {size} and {max_context_len}")
        self.size, self.max_context_len, self.device = size, max_context_len, torch.device(device)
        self.req_to_token = torch.zeros((size, max_context_len), dtype=torch.int32, device=self.device)
        self._free = list(range(size))
        self._last_index: torch.Tensor | None = None  # the last write's flat index

    def available_size(self) -> int:
        return len(self._free)

    def alloc(self) -> int:
        if not self._free:
            raise PoolExhaustedError(f"ReqToTokenPool: all {self.size} request slots are in use (raise "
                                     "--max-running-requests or wait for requests to finish; ask available_size())")
        return self._free.pop(0)

    def free(self, row: int) -> None:
        if not 0 <= row < self.size:
            raise ValueError(f"ReqToTokenPool.free: request slot {row} is out of range [0, {self.size})")
        if row in self._free:
            raise ValueError(f"ReqToTokenPool.free: request slot {row} is not allocated (double free?)")
        self._free.append(row)

    def write(self, parts: Sequence[tuple[int, int, int]], slots: torch.Tensor, steady: bool = False) -> None:
        """For each (row, start, n), `req_to_token[row, start:start + n]` = the next n of `slots`. `steady`: the last
        write's rows, each a position further (a decode step after one of the same requests): the index is the last plus
        one, on the device. NOTE: one scatter for all parts: 56 vs 640 us row by row at 64 rows."""
        if steady:
            assert self._last_index is not None and len(parts) == self._last_index.numel(), "not the last write's rows"
            index = self._last_index + 1
        else:
            if (total := sum(n for _, _, n in parts)) != slots.numel():
                raise ValueError(f"ReqToTokenPool.write: {slots.numel()} slots for {total} positions")
            for row, start, n in parts:
                if not 0 <= row < self.size:
                    raise ValueError(f"ReqToTokenPool.write: request slot {row} is out of range [0, {self.size})")
                if start < 0 or n < 0 or start + n > self.max_context_len:
                    raise ValueError(f"ReqToTokenPool.write: positions [{start}, {start + n}) exceed max_context_len "
                                     f"{self.max_context_len}")
            w = self.max_context_len
            index = torch.tensor([row * w + p for row, start, n in parts for p in range(start, start + n)],
                                 dtype=torch.int64, device=self.device)
        self._last_index = index
        self.req_to_token.view(-1).index_copy_(0, index, slots.reshape(-1).to(self.req_to_token))

    def check_integrity(self) -> bool:
        assert len(set(self._free)) == len(self._free), "ReqToTokenPool: free list holds duplicate request slots"
        assert all(0 <= i < self.size for i in self._free), "ReqToTokenPool: free list holds out-of-range slots"
        return True


@dataclass(eq=False)
class ReqKV:
    """One live request's KV (changed only by the manager). Its slots live in one place, its req_to_token row: positions
    [0, num_computed); the first `cached` are the radix tree's (shared, locked through `node`), the rest its own."""

    row: int  # the request's row of the req_to_token table
    node: TreeNode
    cached: int
    num_computed: int
    found: Counter[str] = field(default_factory=Counter)  # its prefix's tokens by the tier they came from, or missed


class KVCacheManager:
    """With a `hicache` (host, disk tiers), device-tree evictions are saved below it; prefixes found there load back."""

    def __init__(self, size: int, max_requests: int, context_len: int, device: str | torch.device = "cpu",
                 disable_radix_cache: bool = False, hicache: HiCache | None = None) -> None:
        self.allocator, self.size = TokenSlotAllocator(size, device), size  # (size: allocatable token slots)
        self.req_to_token, self.hicache = ReqToTokenPool(max_requests, context_len, device), hicache
        self.table = self.req_to_token.req_to_token  # (row, position) -> slot, int32 (attention reads it)
        self.radix = RadixCache(self.allocator, disable_radix_cache, hicache.save if hicache else None)
        self._live: set[ReqKV] = set()
        self.hit_tokens = Counter(device=0, host=0, disk=0, miss=0)  # prefix tokens per tier found, by released reqs

    def free_slots(self) -> int:
        return self.allocator.available_size()

    def evictable_slots(self) -> int:
        return self.radix.evictable_size()

    def cached_slots(self) -> int:
        return self.radix.total_size()

    def room(self) -> int:
        return self.allocator.available_size() + self.radix.evictable_size()

    def can_admit(self) -> bool:
        return self.req_to_token.available_size() > 0

    def can_allocate(self, n: int) -> bool:
        return n <= self.room()

    def num_live(self) -> int:
        return len(self._live)

    def slots(self, kv: ReqKV) -> torch.Tensor:
        """The request's slots, position by position (a view of its table row: read, do not write)."""
        return self.table[kv.row, :kv.num_computed]

    def admit(self, prefix_ids: Sequence[int]) -> ReqKV:
        """A row for a new request and the longest cached prefix (locked) of `prefix_ids`, the tokens it may take."""
        row = self.req_to_token.alloc()
        slots, node = self.radix.match_prefix(prefix_ids)
        self.radix.inc_lock_ref(node)
        found = Counter(device=slots.numel())
        if self.hicache is not None:
            slots, node = self._load_back(list(prefix_ids), slots, node, found)
        found["miss"] = len(prefix_ids) - slots.numel()
        self.table[row, :slots.numel()] = slots  # (not `write`: its last index, a steady decode step's, stays)
        kv = ReqKV(row, node, int(slots.numel()), int(slots.numel()), found)
        self._live.add(kv)
        return kv

    def _load_back(self, tokens: list[int], slots: torch.Tensor, node: TreeNode, found: Counter[str]
                   ) -> tuple[torch.Tensor, TreeNode]:
        """Extend a device match (`node` locked) from the host and disk: copied into new device slots, put in the
        device tree, the longer match returned locked. Left as it is when the device has no room for it."""
        host, host_node, from_disk = self.hicache.match(tokens)
        have, n = slots.numel(), host.numel() - slots.numel()
        if n > 0 and self.can_allocate(n):
            self.radix.evict(n - self.allocator.available_size())
            new = self.allocator.alloc(n)
            if self.hicache.load(host[have:], new):
                self.radix.cache_finished_req(tokens[:have + n], torch.cat([slots, new]), node, have)
                slots, node = self.radix.match_prefix(tokens)
                self.radix.inc_lock_ref(node)
                found.update(host=n - min(from_disk, n), disk=min(from_disk, n))
            else:  # (a failed copy, logged: the rest of the prefix is recomputed)
                self.allocator.free(new)
        self.hicache.unlock(host_node)
        return slots, node

    def allocate(self, parts: Sequence[tuple[ReqKV, int]], steady: bool = False) -> torch.Tensor:
        """Give each request its next `n` slots (evicting if needed), written to its row after the ones it
        has. Returns all new slots in order (the step's out_cache_loc). `steady`: see `ReqToTokenPool.write`."""
        if not self.can_allocate(total := sum(n for _, n in parts)):
            raise PoolExhaustedError(f"KVCacheManager: {total} slots asked, {self.room()} free or evictable "
                                     "(ask can_allocate() first)")
        self.radix.evict(total - self.allocator.available_size())  # (a no-op unless short of free slots)
        slots = self.allocator.alloc(total)
        self.req_to_token.write([(kv.row, kv.num_computed, n) for kv, n in parts], slots, steady)
        for kv, n in parts:
            kv.num_computed += n
        return slots

    def release(self, kv: ReqKV, token_ids: Sequence[int], cache: bool = True) -> None:
        """A finished, aborted or retracted request gives its KV back: the tokens it computed
        (`token_ids`, one per slot) go to the prefix cache, its duplicates and its row are freed. `cache=False`
        (after a failed step, whose slots may never have been written): its own slots are only freed."""
        self._live.remove(kv)
        if not cache:
            self.radix.dec_lock_ref(kv.node)
            self.allocator.free(self.slots(kv)[kv.cached:])
        else:
            if kv.num_computed > kv.cached:  # (not one admitted and given back before it ran)
                self.hit_tokens.update(kv.found)
            if self.hicache is not None and self.hicache.write_through:
                self.hicache.save(list(token_ids), self.slots(kv))
            self.radix.cache_finished_req(token_ids, self.slots(kv), kv.node, kv.cached)  # (it clones what it keeps)
        self.req_to_token.free(kv.row)

    def flush(self) -> bool:
        """Drop the prefix cache; refused (False) while any request holds KV."""
        if self._live:
            return False
        self.radix.flush()
        if self.hicache is not None:
            self.hicache.flush()
        return True

    def check_integrity(self) -> bool:
        assert self.allocator.check_integrity() and self.req_to_token.check_integrity()
        assert self.radix.check_integrity() and (self.hicache is None or self.hicache.check_integrity())
        both = torch.cat([*(self.slots(kv)[kv.cached:].to(torch.int64) for kv in self._live), self.radix.all_slots()])
        assert both.unique().numel() == both.numel(), "KVCacheManager: a slot is owned twice"
        total = self.allocator.available_size() + both.numel()
        assert total == self.size, f"KVCacheManager: slots leaked: free+owned+cached={total} != {self.size}"
        rows_in_use = self.req_to_token.size - self.req_to_token.available_size()
        assert rows_in_use == len(self._live), "KVCacheManager: request rows leaked"
        assert len({kv.row for kv in self._live}) == len(self._live), "KVCacheManager: two requests share a row"
        for kv in self._live:
            assert 0 <= kv.cached <= kv.num_computed <= self.req_to_token.max_context_len, (
                f"KVCacheManager: row {kv.row} has cached={kv.cached}, num_computed={kv.num_computed}")
        return True
