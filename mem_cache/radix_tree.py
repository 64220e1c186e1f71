"""Radix-tree nodes and tree-level helpers for `RadixCache` (key matching, structural self-check)."""

from __future__ import annotations

import heapq
from collections.abc import Iterator

import torch

from mem_cache.allocator import TokenSlotAllocator

ChildKey = int | tuple[int, ...]


class TreeNode:
    """One edge of the radix tree: a run of token ids (`key`) and the KV slots that hold them (`value`).

    `children` maps the first token of a child's key (the first page as a tuple when page_size > 1)
    to the child. `lock_ref` counts the requests using this node (directly or through a descendant);
    a node with `lock_ref > 0` is never evicted. `last_access` is the cache's logical clock at the
    last match or insert that went through this node (LRU order).
    """

    __slots__ = ("children", "key", "value", "parent", "lock_ref", "last_access", "node_id")

    def __init__(
        self,
        node_id: int,
        key: list[int],
        value: torch.Tensor,
        parent: TreeNode | None,
        last_access: int,
    ) -> None:
        self.node_id = node_id
        self.children: dict[ChildKey, TreeNode] = {}
        self.key = key
        # NOTE: value[i] is the slot holding the KV of key[i]; len(value) == len(key) always.
        self.value = value
        self.parent = parent
        self.lock_ref = 0
        self.last_access = last_access

    def is_leaf(self) -> bool:
        """True when the node has no children."""
        return not self.children

    def __repr__(self) -> str:
        head = self.key[:6]
        more = "..." if len(self.key) > 6 else ""
        return (
            f"TreeNode(id={self.node_id}, len={len(self.key)}, key={head}{more}, "
            f"lock_ref={self.lock_ref}, last_access={self.last_access})"
        )


def child_key(tokens: list[int], start: int, page_size: int) -> ChildKey:
    """The `children` dict key of a key run starting at `tokens[start]`."""
    if page_size == 1:
        return tokens[start]
    return tuple(tokens[start : start + page_size])


def match_len(node_key: list[int], tokens: list[int], start: int, page_size: int) -> int:
    """Length of the common prefix of `node_key` and `tokens[start:]`, floored to whole pages."""
    n = min(len(node_key), len(tokens) - start)
    i = 0
    while i < n and node_key[i] == tokens[start + i]:
        i += 1
    return i - i % page_size


def duplicate_slots(req_slots: torch.Tensor, tree_slots: torch.Tensor, alloc_page_size: int) -> torch.Tensor:
    """The request's slots for tokens the tree already holds in other slots (the ones to free)."""
    dup = req_slots != tree_slots
    # NOTE: a page is either entirely the tree's or entirely the request's; a mixed page means the
    # caller's slots do not follow the page layout, and freeing it would free tree slots.
    pages = dup.view(-1, alloc_page_size)
    if bool((pages.any(dim=1) != pages.all(dim=1)).any()):
        raise RuntimeError("RadixCache: a page mixes the tree's slots and the request's slots")
    return req_slots[dup]


def iter_nodes(root: TreeNode) -> Iterator[TreeNode]:
    """Every node below `root` (root excluded), parents before children."""
    stack = list(root.children.values())
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def split_node(node: TreeNode, m: int, page_size: int, node_id: int) -> TreeNode:
    """Cut `node` after `m` tokens; return the new upper part, inserted between node and its parent.

    NOTE: the original object stays the deeper part so that nodes held by requests stay valid; the
    new parent inherits lock_ref and last_access, so every size and lock invariant is unchanged.
    """
    parent = node.parent
    assert parent is not None and 0 < m < len(node.key) and m % page_size == 0
    upper = TreeNode(node_id, node.key[:m], node.value[:m], parent, node.last_access)
    upper.lock_ref = node.lock_ref
    parent.children[child_key(upper.key, 0, page_size)] = upper
    node.key, node.value, node.parent = node.key[m:], node.value[m:], upper
    upper.children[child_key(node.key, 0, page_size)] = node
    return upper


def pop_lru_leaves(root: TreeNode, num_tokens: int, page_size: int) -> list[TreeNode]:
    """Detach least-recently-used unlocked leaves until they hold >= `num_tokens` tokens (or none is
    left); a parent left childless and unlocked becomes a candidate. Returns the detached nodes."""
    # NOTE: (last_access, node_id) is unique, so the heap never compares TreeNode objects.
    heap = [(n.last_access, n.node_id, n) for n in iter_nodes(root) if n.is_leaf() and n.lock_ref == 0]
    heapq.heapify(heap)
    out: list[TreeNode] = []
    total = 0
    while total < num_tokens and heap:
        _, _, node = heapq.heappop(heap)
        parent = node.parent
        assert parent is not None
        del parent.children[child_key(node.key, 0, page_size)]
        node.parent = None  # NOTE: a detached node is recognized by parent None (it is not the root)
        out.append(node)
        total += len(node.key)
        if parent is not root and parent.is_leaf() and parent.lock_ref == 0:
            heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
    return out


def render_tree(root: TreeNode, max_nodes: int = 200) -> str:
    """The tree as indented text, one node per line (debugging aid)."""
    lines = ["<root>"]
    stack = [(child, 1) for child in reversed(list(root.children.values()))]
    while stack and len(lines) <= max_nodes:
        node, depth = stack.pop()
        lines.append("  " * depth + repr(node))
        stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
    if stack:
        lines.append("  ...")
    return "\n".join(lines)


def check_tree_integrity(
    root: TreeNode,
    page_size: int,
    evictable: int,
    protected: int,
    allocator: TokenSlotAllocator,
) -> bool:
    """Raise `AssertionError` naming the first inconsistency of the tree; return True otherwise."""
    assert root.parent is None and not root.key and root.value.numel() == 0, "RadixCache: malformed root"
    assert root.lock_ref == 0, f"RadixCache: root lock_ref is {root.lock_ref}, expected 0"
    values: list[torch.Tensor] = []
    ev = pr = 0
    for node in iter_nodes(root):
        parent = node.parent
        assert parent is not None and parent.children.get(child_key(node.key, 0, page_size)) is node, (
            f"RadixCache: {node} is not registered under its parent by its first key"
        )
        n = len(node.key)
        assert n > 0 and n % page_size == 0, (
            f"RadixCache: {node} key length {n} is not a positive multiple of page_size {page_size}"
        )
        assert node.value.dtype == torch.int64 and tuple(node.value.shape) == (n,), (
            f"RadixCache: {node} value has dtype {node.value.dtype} and shape {tuple(node.value.shape)}"
        )
        assert node.lock_ref >= 0, f"RadixCache: {node} has a negative lock_ref"
        assert parent is root or parent.lock_ref >= node.lock_ref, (
            f"RadixCache: parent {parent} has a smaller lock_ref than its child {node}"
        )
        if node.lock_ref > 0:
            pr += n
        else:
            ev += n
        values.append(node.value)
    assert (ev, pr) == (evictable, protected), (
        f"RadixCache: counted evictable/protected {(ev, pr)} != tracked {(evictable, protected)}"
    )
    if not values:
        return True
    slots = torch.cat(values).to(allocator.device)
    assert torch.unique(slots).numel() == slots.numel(), "RadixCache: a slot appears twice in the tree"
    aps = allocator.page_size
    lo, hi = aps, (allocator.num_pages + 1) * aps
    assert bool(((slots >= lo) & (slots < hi)).all()), f"RadixCache: a tree slot is outside [{lo}, {hi})"
    # NOTE: reads the allocator's page bitmap directly: it has no public "is allocated" query.
    assert bool(allocator._allocated[slots // aps].all()), (
        "RadixCache: a tree slot lies in a page the allocator considers free"
    )
    if aps > 1:
        rows = slots.view(-1, aps)
        same_page = (rows // aps == rows[:, :1] // aps).all()
        in_order = (rows % aps == torch.arange(aps, device=rows.device)).all()
        assert bool(same_page and in_order), "RadixCache: a tree page does not map onto one allocator page"
    return True
