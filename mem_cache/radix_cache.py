"""RadixCache: a prefix tree from token-id sequences to KV token slots, shared across requests."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mem_cache.allocator import TokenSlotAllocator
from mem_cache.radix_tree import (
    TreeNode,
    check_tree_integrity,
    child_key,
    duplicate_slots,
    iter_nodes,
    match_len,
    pop_lru_leaves,
    render_tree,
    split_node,
)


class RadixCache:
    """Prefix cache over the token-slot allocator, with reference counts and LRU eviction.

    Ownership: a slot is owned by exactly one of the allocator (free), the tree, or one request.
    The tree holds only whole pages (`page_size` tokens); a request's unaligned tail stays its own.
    `match_prefix` hands out the tree's own slots; the caller locks the returned node while it uses
    them (`inc_lock_ref`) and gives them back through `cache_finished_req` /
    `cache_unfinished_req`, which also free the request's slots that duplicate tree tokens.

    LRU time is a logical clock inside the instance (one tick per match or insert), so eviction
    order is deterministic. `disable=True` turns the cache into a pass-through that holds nothing.
    """

    def __init__(self, allocator: TokenSlotAllocator, page_size: int = 1, disable: bool = False) -> None:
        if page_size <= 0 or page_size % allocator.page_size != 0:
            raise ValueError(
                f"RadixCache: page_size ({page_size}) must be a positive multiple of the allocator's "
                f"page_size ({allocator.page_size}), or freeing one tree token would free a whole page"
            )
        self.allocator = allocator
        self.page_size = page_size
        self.disable = disable
        self._clock = 0
        self._next_id = 0
        self._evictable = 0
        self._protected = 0
        self.root = self._new_node([], self._empty(), None)

    def total_size(self) -> int:
        """Tokens (= slots) held by the tree."""
        return self._evictable + self._protected

    def evictable_size(self) -> int:
        """Tokens held by unlocked nodes (what `evict` could free)."""
        return self._evictable

    def protected_size(self) -> int:
        """Tokens held by locked nodes."""
        return self._protected

    def all_slots(self) -> torch.Tensor:
        """Every slot the tree holds (int64, 1-D), for ownership checks."""
        values = [n.value for n in iter_nodes(self.root) if n is not self.root]
        return torch.cat(values) if values else self._empty()

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[torch.Tensor, TreeNode]:
        """Slots (int64, 1-D) of the longest cached page-aligned prefix, and the deepest matched node.

        When the match ends inside a node, that node is split so the returned node ends exactly at
        the match. Touches the LRU time of every node on the path. The slots stay the tree's: lock
        the node (`inc_lock_ref`) before anything can evict.
        """
        if self.disable:
            return self._empty(), self.root
        tokens = self._aligned(token_ids)
        now = self._tick()
        node, pos, values = self.root, 0, []
        while pos < len(tokens):
            child = node.children.get(child_key(tokens, pos, self.page_size))
            if child is None:
                break
            child.last_access = now
            m = match_len(child.key, tokens, pos, self.page_size)
            if m < len(child.key):
                child = self._split(child, m)
            values.append(child.value)
            node, pos = child, pos + m
        return self._cat(values), node

    def insert(self, token_ids: Sequence[int], slots: torch.Tensor) -> int:
        """Insert the page-aligned part of `token_ids` (KV in `slots`); return how many leading tokens
        were already in the tree.

        The request's slots for the newly inserted tokens now belong to the tree. For the first
        (returned) tokens the tree keeps its own slots: the caller still owns its `slots` there and
        must free those that are not the tree's (`cache_finished_req` does this). Its unaligned tail
        also stays the caller's. Disabled: inserts nothing, returns 0.
        """
        if self.disable:
            return 0
        prefix_len, _, _ = self._insert(token_ids, self._as_slots(token_ids, slots), split_at_end=False)
        return prefix_len

    def cache_finished_req(
        self, token_ids: Sequence[int], slots: torch.Tensor, locked_node: TreeNode
    ) -> None:
        """Hand a finished (or aborted) request's KV to the tree and release its lock.

        `slots[i]` holds the KV of `token_ids[i]`; the first ones may be the tree's own slots from
        `match_prefix`. Inserts the page-aligned part, frees the request's slots that duplicate tree
        tokens and the unaligned tail, then unlocks `locked_node`. Disabled: frees every slot.
        """
        slots = self._as_slots(token_ids, slots)
        if self.disable:
            self.allocator.free(slots)
            return
        # NOTE: unlocking first is safe (nothing is evicted in between) and leaves the tree untouched
        # when the unlock is unbalanced.
        self.dec_lock_ref(locked_node)
        prefix_len, tree_slots, _ = self._insert(token_ids, slots, split_at_end=False)
        self.allocator.free(duplicate_slots(slots[:prefix_len], tree_slots, self.allocator.page_size))
        self.allocator.free(slots[self._aligned_len(len(slots)) :])

    def cache_unfinished_req(
        self, token_ids: Sequence[int], slots: torch.Tensor, locked_node: TreeNode
    ) -> tuple[torch.Tensor, TreeNode]:
        """Cache what a chunked prefill has computed so far; return (slots to use from now on, new node).

        Inserts the page-aligned part, frees the request's duplicate slots, and moves the lock from
        `locked_node` to the node ending at the aligned length. The returned slots (int64) are the
        tree's for the aligned part plus the request's own unaligned tail; the caller must write them
        into its req_to_token row. Disabled: returns (slots, root) unchanged.
        """
        if self.disable:
            return slots, self.root
        slots = self._as_slots(token_ids, slots)
        self._locked_path(locked_node)  # validate before touching anything
        prefix_len, tree_slots, node = self._insert(token_ids, slots, split_at_end=True)
        self.allocator.free(duplicate_slots(slots[:prefix_len], tree_slots, self.allocator.page_size))
        # NOTE: lock the new path before unlocking the old one so their shared part never flips state.
        self.inc_lock_ref(node)
        self.dec_lock_ref(locked_node)
        return torch.cat([tree_slots, slots[prefix_len:]]), node

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock the path root -> `node`: none of its nodes can be evicted until `dec_lock_ref`."""
        for n in self._path(node):
            if n.lock_ref == 0:
                self._evictable -= len(n.key)
                self._protected += len(n.key)
            n.lock_ref += 1

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one `inc_lock_ref(node)`; nodes whose count reaches 0 become evictable."""
        for n in self._locked_path(node):
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._evictable += len(n.key)
                self._protected -= len(n.key)

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` slots (if that many are evictable) from least-recently-used
        unlocked leaves; a parent left childless becomes a candidate. Returns the slots freed."""
        if self.disable or num_tokens <= 0:
            return 0
        evicted = pop_lru_leaves(self.root, num_tokens, self.page_size)
        num_freed = sum(len(n.key) for n in evicted)
        self._evictable -= num_freed
        if evicted:
            self.allocator.free(torch.cat([n.value for n in evicted]))
        return num_freed

    def flush(self) -> None:
        """Drop every node and free its slots. Raises `RuntimeError` if any node is locked."""
        locked = [n for n in self.root.children.values() if n.lock_ref > 0]
        if locked:
            raise RuntimeError(
                f"RadixCache.flush: {self._protected} tokens are locked by running requests "
                f"(e.g. {locked[0]}); finish or abort them first"
            )
        nodes = list(iter_nodes(self.root))
        if nodes:
            self.allocator.free(torch.cat([n.value for n in nodes]))
        for n in nodes:
            n.parent = None
        self.root.children.clear()
        self._evictable = self._protected = 0

    def check_integrity(self) -> bool:
        """Raise `AssertionError` with a message on any inconsistency; return True otherwise.

        Checks: no slot twice in the tree, lock_ref >= 0 and parent >= child, tracked sizes equal
        the node lengths, every tree slot allocated (and pages intact when page_size > 1).
        """
        return check_tree_integrity(
            self.root, self.page_size, self._evictable, self._protected, self.allocator
        )

    def pretty_print(self) -> str:
        """The tree as indented text, one node per line (returned, not printed)."""
        return render_tree(self.root)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.allocator.device)

    def _new_node(self, key: list[int], value: torch.Tensor, parent: TreeNode | None) -> TreeNode:
        self._next_id += 1
        return TreeNode(self._next_id, key, value, parent, self._clock)

    def _aligned_len(self, n: int) -> int:
        return n - n % self.page_size

    def _aligned(self, token_ids: Sequence[int]) -> list[int]:
        return [int(t) for t in token_ids[: self._aligned_len(len(token_ids))]]

    def _as_slots(self, token_ids: Sequence[int], slots: torch.Tensor) -> torch.Tensor:
        slots = slots.reshape(-1).to(device=self.allocator.device, dtype=torch.int64)
        if slots.numel() != len(token_ids):
            raise ValueError(f"RadixCache: {slots.numel()} slots given for {len(token_ids)} tokens")
        return slots

    def _path(self, node: TreeNode) -> list[TreeNode]:
        """Nodes from `node` up to (excluding) the root; raises if `node` left the tree."""
        path = []
        while node is not self.root:
            if node.parent is None:
                raise RuntimeError(f"RadixCache: {node} is no longer in the tree (evicted or flushed)")
            path.append(node)
            node = node.parent
        return path

    def _locked_path(self, node: TreeNode) -> list[TreeNode]:
        path = self._path(node)
        if any(n.lock_ref <= 0 for n in path):
            raise RuntimeError(f"RadixCache: {node} is not locked (unbalanced dec_lock_ref)")
        return path

    def _split(self, node: TreeNode, m: int) -> TreeNode:
        self._next_id += 1
        return split_node(node, m, self.page_size, self._next_id)

    def _insert(
        self, token_ids: Sequence[int], slots: torch.Tensor, split_at_end: bool
    ) -> tuple[int, torch.Tensor, TreeNode]:
        """Insert the aligned part; return (tokens already present, the tree's slots for them, the node
        reached). With `split_at_end` the returned node ends exactly at the aligned length."""
        tokens = self._aligned(token_ids)
        now = self._tick()
        node, pos, shared = self.root, 0, []
        while pos < len(tokens):
            key = child_key(tokens, pos, self.page_size)
            child = node.children.get(key)
            if child is None:
                leaf = self._new_node(tokens[pos:], slots[pos : len(tokens)].clone(), node)
                node.children[key] = leaf
                self._evictable += len(leaf.key)
                return pos, self._cat(shared), leaf
            child.last_access = now
            m = match_len(child.key, tokens, pos, self.page_size)
            if m < len(child.key):
                if pos + m == len(tokens) and not split_at_end:
                    shared.append(child.value[:m])
                    return pos + m, self._cat(shared), child
                child = self._split(child, m)
            shared.append(child.value)
            node, pos = child, pos + m
        return pos, self._cat(shared), node

    def _cat(self, values: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(values) if values else self._empty()
