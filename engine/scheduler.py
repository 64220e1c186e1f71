"""Continuous batching: waiting queue -> prefill batches under a token budget (chunked, prefix-cache
aware) -> all running requests decode together; retraction when slots run out; abort anywhere.

The scheduler owns every request's KV slots. Its invariant (checked by `check_integrity`): each
allocated slot belongs either to the radix tree or to exactly one live request.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from engine.model_runner import ExtendItem, ModelRunner
from engine.request import Req
from mem_cache import RadixCache


@dataclass
class ScheduledBatch:
    reqs: list[Req]
    items: list[ExtendItem]
    out_cache_loc: torch.Tensor
    is_prefill: bool

    def completes_prefill(self, i: int) -> bool:
        """Whether request i has all its tokens computed after this batch (so it samples next)."""
        return self.reqs[i].remaining_prefill() == 0


class Scheduler:
    def __init__(self, runner: ModelRunner, radix: RadixCache, max_running_requests: int,
                 chunked_prefill_size: int) -> None:
        self.runner, self.radix = runner, radix
        self.allocator, self.req_pool = runner.allocator, runner.req_to_token_pool
        self.max_running = max_running_requests
        self.chunk = chunked_prefill_size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []

    # ---- queue management -------------------------------------------------------------------
    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def find(self, rid: str) -> Req | None:
        return next((r for r in (*self.waiting, *self.running) if r.rid == rid), None)

    def release(self, req: Req) -> None:
        """Give back a finished or aborted request's KV: shared prefix to the tree, the rest freed."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free_kv(req)

    def retract(self, req: Req) -> None:
        """Put a running request back at the head of the queue; it will be recomputed later."""
        self.running.remove(req)
        self._free_kv(req)
        req.num_retractions += 1
        self.waiting.appendleft(req)

    def _free_kv(self, req: Req) -> None:
        if req.row < 0:
            return
        n = req.num_computed
        self.radix.cache_finished_req(req.all_ids[:n], req.slots, req.tree_node)
        self.req_pool.free(req.row)
        req.row, req.slots, req.tree_node, req.tree_len = -1, None, None, 0

    # ---- batch formation --------------------------------------------------------------------
    def next_batch(self) -> ScheduledBatch | None:
        return self._prefill_batch() or self._decode_batch()

    def _make_room(self, n: int) -> bool:
        if self.allocator.available_size() < n:
            self.radix.evict(n - self.allocator.available_size())
        return self.allocator.available_size() >= n

    def _admit(self, req: Req) -> None:
        """Give a request a ReqToTokenPool row and its cached prefix (locked in the tree)."""
        req.row = self.req_pool.alloc(1)[0]
        ids = req.all_ids
        limit = len(ids) - 1  # at least one token must be computed to get logits
        lp = req.logprob
        if lp.return_logprob and lp.logprob_start_len >= 0 and not req.prompt_logprobs_done:
            limit = min(limit, max(lp.logprob_start_len - 1, 0))  # prompt logprobs need those logits
        prefix, node = self.radix.match_prefix(ids[:limit])
        self.radix.inc_lock_ref(node)
        req.slots, req.tree_node, req.tree_len = prefix, node, len(prefix)
        if req.num_retractions == 0:
            req.cached_tokens = len(prefix)
        if len(prefix):
            self.req_pool.write(req.row, 0, prefix)

    def _prefill_batch(self) -> ScheduledBatch | None:
        budget, chosen = self.chunk, []
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) + len(chosen) >= self.max_running:
                break
            if req.depends_on is not None and not req.depends_on.finished:
                continue
            if req.row < 0:
                if not self.req_pool.can_alloc(1):
                    break
                self._admit(req)
            n = min(budget, req.remaining_prefill())
            # NOTE: keep one free slot per request that will decode next step, so admitting new
            # work does not immediately force a retraction.
            reserve = len(self.running) + len(chosen) + 1 + sum(k for _, k in chosen)
            if not self._make_room(n + reserve):
                n = self.allocator.available_size() - reserve
                if n <= 0 or chosen or self.running:
                    if req.num_computed == req.tree_len:  # nothing computed yet: give the row back
                        self._free_kv(req)
                    break
            chosen.append((req, n))
            budget -= n
        if not chosen:
            return None
        return self._build(chosen, is_prefill=True)

    def _decode_batch(self) -> ScheduledBatch | None:
        while self.running and not self._make_room(len(self.running)):
            self.retract(max(self.running, key=lambda r: r.created))  # newest first
        if not self.running:
            return None
        # NOTE: rows sorted by length let attention pad each length bucket only to its own longest row
        ordered = sorted(self.running, key=lambda r: r.num_computed)
        return self._build([(r, 1) for r in ordered], is_prefill=False)

    def _build(self, chosen: list[tuple[Req, int]], is_prefill: bool) -> ScheduledBatch:
        slots = self.allocator.alloc(sum(n for _, n in chosen))
        items, start = [], 0
        for req, n in chosen:
            own = slots[start:start + n]
            start += n
            prefix = req.num_computed
            self.req_pool.write(req.row, prefix, own)
            items.append(ExtendItem(req.row, prefix, req.all_ids[prefix:prefix + n]))
            req.slots = own if req.slots is None else torch.cat([req.slots, own])
        reqs = [r for r, _ in chosen]
        if is_prefill:
            for r in reqs:
                if r.remaining_prefill() == 0:
                    self.waiting.remove(r)
                    self.running.append(r)
        return ScheduledBatch(reqs, items, slots, is_prefill)

    # ---- invariants -------------------------------------------------------------------------
    def check_integrity(self) -> bool:
        """free + owned-by-requests + held-by-tree == total, and no slot owned twice."""
        assert self.allocator.check_integrity() and self.req_pool.check_integrity() and self.radix.check_integrity()
        live = [r for r in (*self.waiting, *self.running) if r.row >= 0]
        owned = [r.slots[r.tree_len:] for r in live if r.slots is not None]
        own = torch.cat(owned) if owned else torch.empty(0, dtype=torch.int64)
        tree = self.radix.all_slots()
        both = torch.cat([own.to(tree.device), tree])
        assert both.unique().numel() == both.numel(), "a slot is owned twice"
        total = self.allocator.available_size() + both.numel()
        assert total == self.allocator.size, f"slots leaked: free+owned+cached={total} != {self.allocator.size}"
        assert self.req_pool.used_size() == len(live), "ReqToTokenPool rows leaked"
        return True
