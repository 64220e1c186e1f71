"""RadixCache: a prefix tree from token-id sequences to KV token slots, shared across requests."""

import heapq
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch

from mem_cache.allocator import TokenSlotAllocator


@dataclass(eq=False, slots=True)
class TreeNode:
    """One edge: a run of token ids (`key`), the slots holding their KV (`value`), children by first token.
    `lock_ref` counts the requests using it (a locked node is never evicted); `last_access` is the LRU clock."""

    node_id: int
    key: list[int]
    value: torch.Tensor  # NOTE: value[i] is the slot holding the KV of key[i]
    parent: "TreeNode | None"
    last_access: int
    children: "dict[int, TreeNode]" = field(default_factory=dict)
    lock_ref: int = 0

    def __repr__(self) -> str:
        more = "..." if len(self.key) > 6 else ""
        return f"TreeNode(id={self.node_id}, len={len(self.key)}, key={self.key[:6]}{more}, lock_ref={self.lock_ref})"


class RadixCache:
    """Prefix cache over the token-slot allocator: reference counts and LRU eviction. `match_prefix` hands out the
    tree's own slots; the caller locks the node (`inc_lock_ref`) while using them, then passes the request's KV to
    `cache_finished_req`, which frees its copies of tokens the tree holds. LRU time is a logical clock (a tick per match
    or insert). `disable=True`: holds nothing. `on_evict(token_ids, slots)` sees an evicted leaf's prefix first."""

    def __init__(self, allocator: TokenSlotAllocator, disable: bool = False,
                 on_evict: Callable[[list[int], torch.Tensor], None] | None = None) -> None:
        self.allocator, self.disable, self.on_evict = allocator, disable, on_evict
        self._clock = self._next_id = self._total = self._protected = 0
        self.root = self._node([], self._empty(), None)

    def total_size(self) -> int:
        """Tokens (= slots) held by the tree."""
        return self._total

    def evictable_size(self) -> int:
        """Tokens held by unlocked nodes (what `evict` could free)."""
        return self._total - self._protected

    def protected_size(self) -> int:
        return self._protected

    def nodes(self) -> Iterator[TreeNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree holds (int64, 1-D)."""
        return self._cat([n.value for n in self.nodes()])

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, TreeNode]:
        """Slots of `token_ids`' longest cached prefix, its end node (split if the match ends inside): lock it first."""
        if self.disable:
            return self._empty(), self.root
        node, _, values = self._descend(list(token_ids), split_inside=True)
        return self._cat(values), node

    def cache_finished_req(self, token_ids: Sequence[int], slots: torch.Tensor, locked_node: TreeNode,
                           own_from: int) -> None:
        """Hand a finished (or aborted) request's KV to the tree, release its lock. `slots[i]` holds token i's KV: the
        tree's own before `own_from` (`match_prefix`'s), then the caller's, whose copies of tokens the tree holds are
        freed (disabled: all). NOTE: found by position, not by comparing slots: nothing read on the host (a sync)."""
        slots = slots.reshape(-1).to(device=self.allocator.device, dtype=torch.int64)
        if slots.numel() != len(token_ids):
            raise ValueError(f"RadixCache: {slots.numel()} slots given for {len(token_ids)} tokens")
        if self.disable:
            self.allocator.free(slots)
            return
        self.dec_lock_ref(locked_node)  # NOTE: first, so an unbalanced unlock leaves the tree untouched
        node, present, _ = self._descend(tokens := list(token_ids), split_inside=False)
        if present < len(tokens):  # (the tokens after those present: a new leaf, their slots now the tree's)
            node.children[tokens[present]] = self._node(tokens[present:], slots[present:].clone(), node)
            self._total += len(tokens) - present
        assert present >= own_from, f"RadixCache: {own_from} slots given as the tree's, which holds {present} of them"
        self.allocator.free(slots[own_from:present], checked=False)

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock the path root -> `node`: none of its nodes is evicted until `dec_lock_ref`."""
        for n in self._path(node):
            if n.lock_ref == 0:
                self._protected += len(n.key)
            n.lock_ref += 1

    def dec_lock_ref(self, node: TreeNode) -> None:
        path = self._path(node)
        if any(n.lock_ref <= 0 for n in path):
            raise RuntimeError(f"RadixCache: {node} is not locked (unbalanced dec_lock_ref)")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._protected -= len(n.key)

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots (if that many are evictable), least recently used unlocked
        leaves first; a parent left childless becomes a candidate. Returns the slots freed."""
        if self.disable or num_tokens <= 0:
            return 0
        # NOTE: (last_access, node_id) is unique, so the heap never compares nodes.
        heap = [(n.last_access, n.node_id, n) for n in self.nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed, count = [], 0
        while count < num_tokens and heap:
            node = heapq.heappop(heap)[2]
            if self.on_evict is not None:
                path = self._path(node)[::-1]
                self.on_evict([t for n in path for t in n.key], self._cat([n.value for n in path]))
            parent, node.parent = node.parent, None  # NOTE: a detached node is recognized by parent None
            del parent.children[node.key[0]]
            freed.append(node)
            count += len(node.key)
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        self._total -= count
        self.allocator.free(self._cat([n.value for n in freed]), checked=False)  # (the tree's own slots)
        return count

    def flush(self) -> None:
        """Drop every node and free its slots; `RuntimeError` if any node is locked."""
        if self._protected:
            raise RuntimeError(f"RadixCache.flush: {self._protected} tokens are locked by running requests; "
                               "finish or abort them first")
        self.allocator.free(self.all_slots())
        for n in self.nodes():
            n.parent = None
        self.root.children.clear()
        self._total = 0

    def check_integrity(self) -> bool:
        ev = pr = 0
        for node in self.nodes():
            p = node.parent
            assert p is not None and p.children.get(node.key[0]) is node, f"RadixCache: {node} is not under its parent"
            assert node.value.dtype == torch.int64 and node.value.shape == (len(node.key),) and node.key, (
                f"RadixCache: {node} has a value of shape {tuple(node.value.shape)}")
            assert 0 <= node.lock_ref and (p is self.root or p.lock_ref >= node.lock_ref), (
                f"RadixCache: {node} has more locks than its parent")
            pr, ev = (pr + len(node.key), ev) if node.lock_ref else (pr, ev + len(node.key))
        assert (ev, pr) == (self.evictable_size(), self._protected), (
            f"RadixCache: counted evictable/protected {(ev, pr)} != tracked {(self.evictable_size(), self._protected)}")
        slots = self.all_slots()
        assert torch.unique(slots).numel() == slots.numel(), "RadixCache: a slot appears twice in the tree"
        assert self.allocator.is_allocated(slots), "RadixCache: a tree slot is free in the allocator"
        return True

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.allocator.device)

    def _cat(self, values: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(values) if values else self._empty()

    def _node(self, key: list[int], value: torch.Tensor, parent: TreeNode | None) -> TreeNode:
        self._next_id += 1
        return TreeNode(self._next_id, key, value, parent, self._clock)

    def _path(self, node: TreeNode) -> list[TreeNode]:
        """Nodes from `node` up to (excluding) the root; raises if `node` left the tree."""
        path = []
        while node is not self.root:
            if node.parent is None:
                raise RuntimeError(f"RadixCache: {node} is no longer in the tree (evicted or flushed)")
            path.append(node)
            node = node.parent
        return path

    def _split(self, node: TreeNode, m: int) -> TreeNode:
        """Cut `node` after `m` tokens, the new upper part between it and its parent. NOTE: the original object stays
        the deeper part (nodes requests hold stay valid); the upper inherits lock_ref and last_access."""
        upper = self._node(node.key[:m], node.value[:m], node.parent)
        upper.lock_ref, upper.last_access = node.lock_ref, node.last_access
        node.parent.children[upper.key[0]] = upper
        node.key, node.value, node.parent = node.key[m:], node.value[m:], upper
        upper.children[node.key[0]] = node
        return upper

    def _descend(self, tokens: list[int], split_inside: bool) -> tuple[TreeNode, int, list[torch.Tensor]]:
        """Follow `tokens` from the root, touching each node passed: the deepest node reached, the tokens matched
        and their slots. A match ending inside a node splits it, unless it ends `tokens` and not `split_inside`."""
        self._clock += 1
        now, node, pos, values = self._clock, self.root, 0, []
        while pos < len(tokens) and (child := node.children.get(tokens[pos])) is not None:
            child.last_access = now
            m, n = 0, min(len(child.key), len(tokens) - pos)  # (the tokens the child's key shares with the rest)
            while m < n and child.key[m] == tokens[pos + m]:
                m += 1
            if m < len(child.key):
                if not split_inside and pos + m == len(tokens):
                    return child, len(tokens), [*values, child.value[:m]]
                child = self._split(child, m)
            values.append(child.value)
            node, pos = child, pos + m
        return node, pos, values
