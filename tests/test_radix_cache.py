"""mem_cache/radix_cache.py: prefix matching, slot ownership, locks, LRU eviction, paging (CPU, fast)."""

from __future__ import annotations

import random

import pytest
import torch

from mem_cache import RadixCache, TokenSlotAllocator, TreeNode


def make(size: int = 64, page_size: int = 1, disable: bool = False) -> tuple[TokenSlotAllocator, RadixCache]:
    alloc = TokenSlotAllocator(size, page_size)
    return alloc, RadixCache(alloc, page_size=page_size, disable=disable)


def admit(cache: RadixCache, tokens: list[int]) -> tuple[torch.Tensor, TreeNode, int]:
    """What the scheduler does for a new request: match, lock, allocate the rest."""
    prefix, node = cache.match_prefix(tokens)
    cache.inc_lock_ref(node)
    own = cache.allocator.alloc(len(tokens) - len(prefix))
    return torch.cat([prefix, own]), node, len(prefix)


def put(cache: RadixCache, tokens: list[int]) -> torch.Tensor:
    """Compute `tokens` into fresh slots, insert them, free the duplicates (the caller's job)."""
    slots = cache.allocator.alloc(len(tokens))
    present = cache.insert(tokens, slots)
    cache.allocator.free(slots[:present])
    return slots


def tree_slots(cache: RadixCache) -> set[int]:
    out: set[int] = set()
    stack = [cache.root]
    while stack:
        node = stack.pop()
        out.update(node.value.tolist())
        stack.extend(node.children.values())
    return out


# ---- match / insert / split ----------------------------------------------------------------------


def test_match_insert_and_split() -> None:
    alloc, cache = make()
    prefix, node = cache.match_prefix([1, 2, 3])
    assert prefix.numel() == 0 and prefix.dtype == torch.int64 and node is cache.root
    slots = alloc.alloc(5)
    assert cache.insert([1, 2, 3, 4, 5], slots) == 0
    assert cache.total_size() == cache.evictable_size() == 5

    prefix, node = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert prefix.tolist() == slots.tolist() and node.key == [1, 2, 3, 4, 5]

    prefix, node = cache.match_prefix([1, 2, 9])  # ends inside the node: split at 2
    assert prefix.tolist() == slots[:2].tolist()
    assert node.key == [1, 2] and [c.key for c in node.children.values()] == [[3, 4, 5]]
    assert cache.total_size() == 5
    assert cache.match_prefix([7, 1])[0].numel() == 0
    cache.check_integrity()


def test_insert_returns_already_present_prefix() -> None:
    alloc, cache = make()
    a = alloc.alloc(3)
    assert cache.insert([1, 2, 3], a) == 0
    b = alloc.alloc(4)
    assert cache.insert([1, 2, 4, 5], b) == 2  # branches after [1, 2]
    assert cache.total_size() == 5
    assert cache.insert([1, 2, 3], alloc.alloc(3)) == 3  # fully present: nothing new
    assert cache.insert([1, 2], a[:2]) == 2  # a prefix of an existing node: no split needed
    assert cache.total_size() == 5
    assert cache.match_prefix([1, 2, 4, 5])[0].tolist() == a[:2].tolist() + b[2:].tolist()
    cache.check_integrity()


def test_insert_clones_slots() -> None:
    alloc, cache = make()
    slots = alloc.alloc(3)
    cache.insert([1, 2, 3], slots)
    expected = slots.tolist()
    slots.fill_(0)  # e.g. the request's req_to_token row being reused
    assert cache.match_prefix([1, 2, 3])[0].tolist() == expected


def test_length_mismatch_raises() -> None:
    alloc, cache = make()
    with pytest.raises(ValueError, match="2 slots given for 3 tokens"):
        cache.insert([1, 2, 3], alloc.alloc(2))


# ---- request lifecycle ---------------------------------------------------------------------------


def test_cache_finished_req_frees_duplicates() -> None:
    alloc, cache = make(size=64)
    # two requests compute the same prompt concurrently (neither could match the other)
    sa, na, _ = admit(cache, [1, 2, 3, 4])
    sb, nb, _ = admit(cache, [1, 2, 3, 4, 5, 6])
    assert alloc.available_size() == 64 - 10
    cache.cache_finished_req([1, 2, 3, 4], sa, na)
    assert alloc.available_size() == 64 - 10 and cache.total_size() == 4
    cache.cache_finished_req([1, 2, 3, 4, 5, 6], sb, nb)
    # B's 4 duplicate slots went back; its [5, 6] went to the tree
    assert alloc.available_size() == 64 - 6 and cache.total_size() == 6
    assert cache.match_prefix([1, 2, 3, 4, 5, 6])[0].tolist() == sa.tolist() + sb[4:].tolist()
    assert cache.protected_size() == 0
    cache.check_integrity()
    alloc.check_integrity()


def test_cache_finished_req_keeps_tree_slots() -> None:
    alloc, cache = make(size=32)
    s1, n1, _ = admit(cache, [1, 2, 3])
    cache.cache_finished_req([1, 2, 3], s1, n1)
    s2, n2, hit = admit(cache, [1, 2, 3, 7, 8])
    assert hit == 3 and s2[:3].tolist() == s1.tolist()
    assert cache.protected_size() == 3 and cache.evictable_size() == 0
    cache.cache_finished_req([1, 2, 3, 7, 8], s2, n2)  # must not free the tree's own [1, 2, 3] slots
    assert alloc.available_size() == 32 - 5 and cache.total_size() == 5
    assert cache.protected_size() == 0
    cache.check_integrity()


def test_cache_unfinished_req_chunked_prefill() -> None:
    alloc, cache = make(size=64)
    tokens = [5, 6, 7, 8, 9, 10]
    # another request already cached [5, 6, 7]
    s0, n0, _ = admit(cache, [5, 6, 7])
    cache.cache_finished_req([5, 6, 7], s0, n0)
    slots = alloc.alloc(6)  # this request computed everything itself (it was admitted earlier)
    before = alloc.available_size()
    new, node = cache.cache_unfinished_req(tokens[:4], slots[:4], cache.root)
    assert new.tolist() == s0.tolist() + [int(slots[3])]
    assert alloc.available_size() == before + 3  # its 3 duplicate slots were freed
    assert node.key == [8] and node.lock_ref == 1 and cache.protected_size() == 4
    assert cache.evict(100) == 0  # everything is on the locked path
    slots = torch.cat([new, slots[4:]])
    new2, node2 = cache.cache_unfinished_req(tokens, slots, node)
    assert new2.tolist() == slots.tolist() and node2.key == [9, 10]
    assert cache.protected_size() == 6 and cache.evictable_size() == 0
    cache.cache_finished_req(tokens, new2, node2)
    assert cache.protected_size() == 0 and cache.total_size() == 6
    assert alloc.available_size() == 64 - 6
    cache.check_integrity()


def test_cache_unfinished_req_ending_inside_a_node_splits_it() -> None:
    alloc, cache = make(size=32)
    s0 = alloc.alloc(5)
    cache.insert([1, 2, 3, 4, 5], s0)
    mine = alloc.alloc(3)
    new, node = cache.cache_unfinished_req([1, 2, 3], mine, cache.root)
    assert new.tolist() == s0[:3].tolist() and node.key == [1, 2, 3] and node.lock_ref == 1
    assert cache.protected_size() == 3 and cache.evictable_size() == 2
    cache.dec_lock_ref(node)
    cache.check_integrity()


# ---- locks and eviction --------------------------------------------------------------------------


def test_locks_protect_and_unlock_makes_evictable() -> None:
    alloc, cache = make(size=32)
    put(cache, [1, 2, 3, 4])
    put(cache, [1, 2, 7, 8])  # 2 new tokens on a sibling branch
    _, node = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(node)
    cache.inc_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (4, 2)
    assert cache.evict(100) == 2  # only the unlocked sibling [7, 8]
    assert cache.total_size() == 4 and alloc.available_size() == 32 - 4
    cache.dec_lock_ref(node)
    assert cache.evict(100) == 0  # still locked once
    cache.dec_lock_ref(node)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 4)
    assert cache.evict(100) == 4 and alloc.available_size() == 32
    cache.check_integrity()


def test_unbalanced_unlock_and_stale_node_raise() -> None:
    alloc, cache = make()
    cache.insert([1, 2], alloc.alloc(2))
    _, node = cache.match_prefix([1, 2])
    with pytest.raises(RuntimeError, match="not locked"):
        cache.dec_lock_ref(node)
    slots = alloc.alloc(3)
    with pytest.raises(RuntimeError, match="not locked"):  # nothing is inserted or freed
        cache.cache_finished_req([1, 2, 3], slots, node)
    with pytest.raises(RuntimeError, match="not locked"):
        cache.cache_unfinished_req([1, 2, 3], slots, node)
    assert cache.total_size() == 2 and alloc.available_size() == 64 - 5
    alloc.free(slots)
    cache.evict(2)
    with pytest.raises(RuntimeError, match="no longer in the tree"):
        cache.inc_lock_ref(node)
    cache.check_integrity()


def test_lru_order_oldest_leaf_first() -> None:
    alloc, cache = make(size=32)
    put(cache, [1, 1, 1])  # t=1
    put(cache, [2, 2, 2])  # t=2
    put(cache, [3, 3, 3])  # t=3
    cache.match_prefix([1, 1, 1])  # [1,1,1] becomes the newest
    assert cache.evict(1) == 3
    assert cache.match_prefix([2, 2, 2])[0].numel() == 0  # the oldest went first
    assert cache.match_prefix([3, 3, 3])[0].numel() == 3  # touches [3,3,3]
    assert cache.evict(1) == 3
    assert cache.match_prefix([1, 1, 1])[0].numel() == 0
    assert cache.total_size() == 3
    cache.check_integrity()


def test_evict_frees_exactly_what_it_reports_and_climbs_to_parents() -> None:
    alloc, cache = make(size=64)
    put(cache, [1, 2, 3, 4, 5, 6])
    put(cache, [1, 2, 3, 9])  # splits: [1,2,3] -> {[4,5,6], [9]}
    put(cache, [8] * 5)
    assert cache.total_size() == 12
    for want in (1, 2, 4, 100):
        before = alloc.available_size()
        got = cache.evict(want)
        assert alloc.available_size() - before == got
        assert got >= min(want, got + cache.evictable_size())
        cache.check_integrity()
    assert cache.total_size() == 0 and alloc.available_size() == 64
    assert cache.evict(5) == 0


# ---- flush / disabled ----------------------------------------------------------------------------


def test_flush_frees_everything_and_refuses_while_locked() -> None:
    alloc, cache = make(size=32)
    s, n, _ = admit(cache, [1, 2, 3, 4])
    cache.cache_finished_req([1, 2, 3, 4], s, n)
    _, node = cache.match_prefix([1, 2])
    cache.inc_lock_ref(node)
    with pytest.raises(RuntimeError, match="locked"):
        cache.flush()
    assert cache.total_size() == 4  # untouched
    cache.dec_lock_ref(node)
    cache.flush()
    assert cache.total_size() == 0 and alloc.available_size() == 32
    assert cache.match_prefix([1, 2, 3, 4])[0].numel() == 0
    with pytest.raises(RuntimeError):
        cache.inc_lock_ref(node)  # node died with the flush
    cache.check_integrity()
    alloc.check_integrity()


def test_disabled_cache_holds_nothing() -> None:
    alloc, cache = make(size=32, disable=True)
    s, node, hit = admit(cache, [1, 2, 3])
    assert hit == 0 and node is cache.root
    assert cache.insert([1, 2, 3], s) == 0 and cache.total_size() == 0
    new, node2 = cache.cache_unfinished_req([1, 2, 3], s, node)
    assert new is s and node2 is cache.root
    assert cache.match_prefix([1, 2, 3])[0].numel() == 0
    cache.cache_finished_req([1, 2, 3], s, node)
    assert alloc.available_size() == 32 and cache.evict(10) == 0
    cache.flush()
    cache.check_integrity()


# ---- paging --------------------------------------------------------------------------------------


def test_page_size_4_alignment() -> None:
    alloc, cache = make(size=64, page_size=4)
    tokens = list(range(10))
    s, node, hit = admit(cache, tokens)  # 10 tokens -> 3 pages
    assert hit == 0 and alloc.available_size() == 64 - 12
    cache.cache_finished_req(tokens, s, node)
    assert cache.total_size() == 8  # 2 whole pages; the tail page went back
    assert alloc.available_size() == 64 - 8
    prefix, node = cache.match_prefix(tokens[:7])
    assert prefix.tolist() == s[:4].tolist() and node.key == [0, 1, 2, 3]  # split at the page edge
    assert cache.match_prefix([0, 1, 2, 3, 4, 5, 6, 99])[0].numel() == 4  # mismatch inside page 2
    assert cache.match_prefix([0, 1, 2])[0].numel() == 0
    s7 = alloc.alloc(7)
    assert cache.insert(list(range(7)), s7) == 4  # only 4 aligned tokens, all already present
    alloc.free(s7)  # all of them are the caller's: duplicates and tail
    assert alloc.available_size() == 64 - 8
    assert cache.evict(1) == 4  # whole pages
    cache.check_integrity()
    alloc.check_integrity()


def test_page_size_4_unfinished_keeps_tail() -> None:
    alloc, cache = make(size=64, page_size=4)
    tokens = list(range(6))
    slots = alloc.alloc(6)
    new, node = cache.cache_unfinished_req(tokens, slots, cache.root)
    assert new.tolist() == slots.tolist() and node.key == [0, 1, 2, 3]
    assert cache.total_size() == 4 and alloc.available_size() == 64 - 8  # tail page is still the request's
    cache.cache_finished_req(tokens, new, node)
    assert alloc.available_size() == 64 - 4
    cache.check_integrity()


def test_page_size_must_fit_the_allocator() -> None:
    with pytest.raises(ValueError, match="multiple of the allocator"):
        RadixCache(TokenSlotAllocator(16, 4), page_size=1)


# ---- randomized simulation -----------------------------------------------------------------------


class Sim:
    """A toy scheduler: requests share prompt prefixes, compute in chunks, finish or abort, and the
    cache is evicted under pressure. `content[slot]` is the token prefix whose KV the slot holds."""

    def __init__(self, seed: int, page_size: int) -> None:
        self.rng = random.Random(seed)
        self.alloc = TokenSlotAllocator(256, page_size)
        self.cache = RadixCache(self.alloc, page_size=page_size)
        self.content: dict[int, tuple[int, ...] | None] = {}
        self.live: list[dict] = []
        self.bases = [[self.rng.randrange(6) for _ in range(40)] for _ in range(5)]
        self.admitted = 0

    def tokens(self) -> list[int]:
        base = self.rng.choice(self.bases)[: self.rng.randrange(0, 40)]
        return base + [self.rng.randrange(6) for _ in range(self.rng.randrange(1, 20))]

    def check_match(self, tokens: list[int], slots: torch.Tensor) -> None:
        for i, slot in enumerate(slots.tolist()):
            assert self.content[slot] == tuple(tokens[: i + 1]), f"slot {slot} holds the wrong KV"

    def compute(self, req: dict, upto: int) -> None:
        for i in range(req["computed"], upto):
            self.content[int(req["slots"][i])] = tuple(req["tokens"][: i + 1])
        req["computed"] = upto

    def admit(self) -> None:
        tokens = self.tokens()
        prefix, node = self.cache.match_prefix(tokens)
        self.check_match(tokens, prefix)
        self.cache.inc_lock_ref(node)
        need = len(tokens) - len(prefix)
        if not self.alloc.can_alloc(need):
            self.cache.evict(need - self.alloc.available_size())
        if not self.alloc.can_alloc(need):
            self.cache.dec_lock_ref(node)
            return
        own = self.alloc.alloc(need)
        self.content.update(dict.fromkeys(own.tolist()))  # allocated, not computed yet
        slots = torch.cat([prefix, own])
        self.live.append({"tokens": tokens, "slots": slots, "node": node, "computed": len(prefix)})
        self.admitted += 1

    def chunk(self, req: dict) -> None:
        n = len(req["tokens"])
        self.compute(req, self.rng.randint(req["computed"], n))
        k = req["computed"]
        new, node = self.cache.cache_unfinished_req(req["tokens"][:k], req["slots"][:k], req["node"])
        self.check_match(req["tokens"], new)
        req["slots"], req["node"] = torch.cat([new, req["slots"][k:]]), node

    def finish(self, req: dict) -> None:
        self.live.remove(req)
        k = req["computed"]
        if k < len(
            req["tokens"]
        ):  # abort: free the never-computed slots, except a page shared with computed ones
            rest = req["slots"][k:]
            if k > 0:
                rest = rest[rest // self.alloc.page_size != req["slots"][k - 1] // self.alloc.page_size]
            self.alloc.free(rest)
        self.cache.cache_finished_req(req["tokens"][:k], req["slots"][:k], req["node"])

    def check(self) -> None:
        self.cache.check_integrity()
        self.alloc.check_integrity()
        in_tree = tree_slots(self.cache)
        assert len(in_tree) == self.cache.total_size()
        ps = self.alloc.page_size
        held: set[int] = set()
        for req in self.live:
            self.check_match(req["tokens"][: req["computed"]], req["slots"][: req["computed"]])
            pages = {s // ps for s in req["slots"].tolist() if s not in in_tree}
            assert not pages & held, "a page is owned by two requests"
            assert not pages & {s // ps for s in in_tree}, "a page is owned by a request and the tree"
            held |= pages
        assert self.alloc.available_size() + self.cache.total_size() + len(held) * ps == self.alloc.size

    def step(self) -> None:
        op = self.rng.random()
        if op < 0.35 or not self.live:
            self.admit()
        elif op < 0.55:
            self.chunk(self.rng.choice(self.live))
        elif op < 0.85:
            req = self.rng.choice(self.live)
            if self.rng.random() < 0.8:
                self.compute(req, len(req["tokens"]))  # finish; otherwise abort mid-way
            self.finish(req)
        elif op < 0.93:
            before = self.alloc.available_size()
            assert self.cache.evict(self.rng.randrange(1, 40)) == self.alloc.available_size() - before
        else:
            tokens = self.tokens()
            self.check_match(tokens, self.cache.match_prefix(tokens)[0])


@pytest.mark.parametrize("page_size", [1, 4])
def test_randomized_simulation(page_size: int) -> None:
    sim = Sim(seed=1234 + page_size, page_size=page_size)
    while sim.admitted < 300:
        sim.step()
        sim.check()
    assert sim.cache.total_size() > 0
    while sim.live:
        sim.finish(sim.live[0])
        sim.check()
    assert sim.cache.protected_size() == 0
    sim.cache.flush()
    sim.check()
    assert sim.alloc.available_size() == sim.alloc.size
