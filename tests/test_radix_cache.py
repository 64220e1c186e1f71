"""mem_cache: the radix prefix cache and the KV cache manager that owns it (CPU, fast).

Prefix matching and splits, duplicate freeing, locks, LRU eviction, flush, the disabled cache, and a
randomized simulation through the manager that tracks which token prefix every slot holds.
"""

from __future__ import annotations

import random

import pytest
import torch

from mem_cache import KVCacheManager, PoolExhaustedError, RadixCache, TokenSlotAllocator


def make(size: int = 64, disable: bool = False) -> tuple[TokenSlotAllocator, RadixCache]:
    alloc = TokenSlotAllocator(size)
    return alloc, RadixCache(alloc, disable=disable)


def put(cache: RadixCache, tokens: list[int]) -> torch.Tensor:
    """Compute `tokens` into fresh slots and hand them to the tree (as a finished request would)."""
    slots = cache.allocator.alloc(len(tokens))
    _, node = cache.match_prefix([])
    cache.inc_lock_ref(node)
    cache.cache_finished_req(tokens, slots, node, 0)
    return slots


def test_match_split_and_duplicates_freed() -> None:
    alloc, cache = make()
    prefix, node = cache.match_prefix([1, 2, 3])
    assert prefix.numel() == 0 and prefix.dtype == torch.int64 and node is cache.root
    slots = put(cache, [1, 2, 3, 4, 5])
    assert cache.total_size() == cache.evictable_size() == 5 and alloc.available_size() == 59
    prefix, node = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert prefix.tolist() == slots.tolist() and node.key == [1, 2, 3, 4, 5]
    prefix, node = cache.match_prefix([1, 2, 9])  # ends inside the node: split at 2
    assert prefix.tolist() == slots[:2].tolist()
    assert node.key == [1, 2] and [c.key for c in node.children.values()] == [[3, 4, 5]]
    other = put(cache, [1, 2, 4, 5])  # branches after [1, 2]: its copies of 1, 2 are freed
    assert cache.total_size() == 7 and alloc.available_size() == 64 - 7
    assert not alloc.is_allocated(other[:2]) and alloc.is_allocated(other[2:])
    put(cache, [1, 2, 3])  # fully present: all three copies freed
    assert cache.total_size() == 7 and alloc.available_size() == 57 and cache.check_integrity()


def test_length_mismatch_and_unbalanced_unlock_raise() -> None:
    alloc, cache = make()
    _, node = cache.match_prefix([])
    with pytest.raises(ValueError, match="2 slots given for 3 tokens"):
        cache.cache_finished_req([1, 2, 3], alloc.alloc(2), node, 0)
    put(cache, [1, 2])
    _, node = cache.match_prefix([1, 2])
    with pytest.raises(RuntimeError, match="not locked"):
        cache.dec_lock_ref(node)
    cache.flush()
    with pytest.raises(RuntimeError, match="no longer in the tree"):
        cache.inc_lock_ref(node)


def test_locks_protect_and_lru_evicts_oldest_leaf_first() -> None:
    alloc, cache = make()
    a, b, c = put(cache, [1, 2]), put(cache, [3, 4]), put(cache, [5, 6])
    cache.match_prefix([1, 2])  # touch a: b is now the oldest
    _, node_c = cache.match_prefix([5, 6])
    cache.inc_lock_ref(node_c)
    assert cache.protected_size() == 2 and cache.evictable_size() == 4
    assert cache.evict(1) == 2 and not alloc.is_allocated(b) and alloc.is_allocated(a)
    assert cache.evict(100) == 2 and not alloc.is_allocated(a)  # c is locked: never evicted
    assert alloc.is_allocated(c) and cache.total_size() == 2
    with pytest.raises(RuntimeError, match="locked"):
        cache.flush()
    cache.dec_lock_ref(node_c)
    cache.flush()
    assert cache.total_size() == 0 and alloc.available_size() == 64 and cache.check_integrity()


def test_evict_climbs_to_parents_left_childless() -> None:
    alloc, cache = make()
    put(cache, [1, 2, 3])
    put(cache, [1, 2, 4])  # [1, 2] -> {[3], [4]}
    assert cache.total_size() == 4 and cache.evict(3) == 4  # both leaves, then their parent
    assert cache.total_size() == 0 and alloc.available_size() == 64


def test_disabled_cache_holds_nothing() -> None:
    alloc, cache = make(disable=True)
    put(cache, [1, 2, 3])
    assert cache.total_size() == 0 and alloc.available_size() == 64
    assert cache.match_prefix([1, 2, 3])[0].numel() == 0 and cache.evict(10) == 0


def test_manager_admit_allocate_release_and_refusals() -> None:
    kv = KVCacheManager(16, 2, 32)
    a = kv.admit([1, 2, 3])
    assert a.cached == 0 and a.num_computed == 0 and kv.can_admit()
    out = kv.allocate([(a, 3)])
    assert kv.slots(a).tolist() == out.tolist() == kv.table[a.row, :3].tolist() and a.num_computed == 3
    kv.release(a, [1, 2, 3])
    b = kv.admit([1, 2, 3, 4])
    assert b.cached == 3 and kv.slots(b).tolist() == out.tolist()  # the tree's slots, locked
    assert not kv.flush()  # b holds KV
    c = kv.admit([])
    assert not kv.can_admit()
    assert kv.can_allocate(13) and not kv.can_allocate(14)  # 13 free; b's prefix is locked
    with pytest.raises(PoolExhaustedError, match="can_allocate"):
        kv.allocate([(c, 14)])
    kv.release(c, [])
    kv.allocate([(b, 1)])
    kv.release(b, [1, 2, 3, 4])
    assert kv.check_integrity() and kv.cached_slots() == 4 and kv.flush() and kv.free_slots() == 16


class Sim:
    """Random requests through the manager; `content[slot]` is the token prefix whose KV it holds."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.kv = KVCacheManager(256, 16, 128)
        self.content: dict[int, tuple[int, ...] | None] = {}
        self.live: list[dict] = []
        self.bases = [[self.rng.randrange(6) for _ in range(40)] for _ in range(5)]
        self.admitted = 0

    def tokens(self) -> list[int]:
        base = self.rng.choice(self.bases)[: self.rng.randrange(0, 40)]
        return base + [self.rng.randrange(6) for _ in range(self.rng.randrange(1, 20))]

    def check_prefix(self, tokens: list[int], slots: torch.Tensor) -> None:
        for i, slot in enumerate(slots.tolist()):
            assert self.content[slot] == tuple(tokens[: i + 1]), f"slot {slot} holds the wrong KV"

    def admit(self) -> None:
        if not self.kv.can_admit():
            return
        tokens = self.tokens()
        rec = self.kv.admit(tokens[:-1])
        self.check_prefix(tokens, self.kv.slots(rec))
        self.live.append({"tokens": tokens, "kv": rec})
        self.admitted += 1

    def extend(self, req: dict) -> None:
        rec, tokens = req["kv"], req["tokens"]
        n = self.rng.randint(1, len(tokens) - rec.num_computed)
        if not self.kv.can_allocate(n):
            return
        start = rec.num_computed
        new = self.kv.allocate([(rec, n)])
        for i, slot in enumerate(new.tolist(), start=start):
            self.content[slot] = tuple(tokens[: i + 1])  # "computed"

    def finish(self, req: dict) -> None:
        self.live.remove(req)
        rec = req["kv"]
        self.kv.release(rec, req["tokens"][:rec.num_computed])

    def step(self) -> None:
        op = self.rng.random()
        pending = [r for r in self.live if r["kv"].num_computed < len(r["tokens"])]
        if op < 0.3 or not self.live:
            self.admit()
        elif op < 0.7 and pending:
            self.extend(self.rng.choice(pending))
        elif op < 0.95:
            self.finish(self.rng.choice(self.live))  # finished or aborted mid-way
        else:
            tokens = self.tokens()
            self.check_prefix(tokens, self.kv.radix.match_prefix(tokens)[0])

    def check(self) -> None:
        assert self.kv.check_integrity()
        for req in self.live:
            rec = req["kv"]
            self.check_prefix(req["tokens"], self.kv.slots(rec))


def test_randomized_simulation_keeps_every_slot_owned_once_and_correct() -> None:
    sim = Sim(seed=1234)
    while sim.admitted < 400:
        sim.step()
        sim.check()
    assert sim.kv.cached_slots() > 0
    while sim.live:
        sim.finish(sim.live[0])
        sim.check()
    assert sim.kv.radix.protected_size() == 0 and sim.kv.flush()
    assert sim.kv.free_slots() == 256
