"""Continuous batching: waiting queue -> prefill batches under a token budget (chunked, prefix-cache aware) ->
all running requests decode together; retraction when slots run out; abort anywhere. No model, no tensors:
every slot question and action goes to `KVCacheManager`, whose `check_integrity` holds after every step."""

from collections import deque
from dataclasses import dataclass
from typing import Any

from engine.runtime.request import Req
from mem_cache import KVCacheManager


@dataclass
class ScheduledBatch:
    """One step: request i (table row rows[i]) feeds its tokens [prefix_lens[i], prefix_lens[i] + len(new_ids[i]))."""

    reqs: list[Req]
    rows: list[int]
    prefix_lens: list[int]
    new_ids: list[list[int]]
    out_cache_loc: Any  # the new tokens' slots, in order (a tensor the manager allocated)
    # the last decode step's requests in order, a token further: table writes, inputs, sampler state stay on the device
    steady: bool = False

    def __post_init__(self) -> None:
        assert len(self.rows) == len(self.prefix_lens) == len(self.new_ids) and all(self.new_ids)
        assert not self.reqs or len(self.reqs) == len(self.rows)


class Scheduler:
    def __init__(self, kv: KVCacheManager, max_running_requests: int, chunked_prefill_size: int) -> None:
        self.kv, self.max_running, self.chunk = kv, max_running_requests, chunked_prefill_size
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self._decoded: list[Req] | None = None  # the last batch's requests, if it was a decode step

    def add(self, req: Req) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def requests(self) -> list[Req]:
        return [*self.waiting, *self.running]

    def release(self, req: Req, cache: bool = True) -> None:
        """Drop a finished or aborted request and give back its KV (to the tree unless `cache` is False)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free_kv(req, cache)

    def retract(self, req: Req) -> None:
        """Put a running request back at the head of the queue; it is recomputed later."""
        self.running.remove(req)
        self._free_kv(req)
        req.num_retractions += 1
        self.waiting.appendleft(req)

    def _free_kv(self, req: Req, cache: bool = True) -> None:
        if req.kv is not None:
            self.kv.release(req.kv, req.all_ids[:req.num_computed], cache)
            req.kv = None

    def next_batch(self) -> ScheduledBatch | None:
        return self._prefill_batch() or self._decode_batch()

    def steady_next(self) -> bool:
        """Whether the next batch may be launched before the last one's tokens are read back (the engine's overlap):
        a steady decode (none waiting or no row for one; the same requests; room), no token on the device a last."""
        full, decoded = len(self.running) >= self.max_running, sorted(self.running, key=lambda r: r.num_computed)
        return ((not self.waiting or full) and decoded == self._decoded and self.kv.can_allocate(len(decoded))
                and not any(r.stop.at_length(len(r.output_ids) + r.inflight, len(r.prompt_ids)) for r in decoded))

    def _admit(self, req: Req) -> None:
        """A row and cached prefix for a request: a token at least is computed (logits), and every prompt logprob's."""
        lp, limit = req.logprob, len(req.prompt_ids) + len(req.output_ids) - 1
        if lp.return_logprob and lp.logprob_start_len >= 0 and not req.prompt_logprobs_done:
            limit = min(limit, max(lp.logprob_start_len - 1, 0))
        req.kv = self.kv.admit(req.ids(0, limit))
        if req.num_retractions == 0:
            req.cached_tokens = req.kv.cached

    def _prefill_batch(self) -> ScheduledBatch | None:
        budget, chosen = self.chunk, []
        for req in list(self.waiting):
            if budget <= 0 or len(self.running) + len(chosen) >= self.max_running:
                break
            if req.depends_on is not None and not req.depends_on.finished:
                continue
            if req.kv is None:
                if not self.kv.can_admit():
                    break
                self._admit(req)
            n = min(budget, req.remaining_prefill())
            # NOTE: keep a slot per request decoding next step: admitting new work must not force a retraction at once.
            reserve = len(self.running) + len(chosen) + 1 + sum(k for _, k in chosen)
            if not self.kv.can_allocate(n + reserve):
                if (n := self.kv.room() - reserve) <= 0 or chosen or self.running:
                    if req.num_computed == req.kv.cached:  # nothing computed yet: give the row back
                        self._free_kv(req)
                    break
            chosen.append((req, n))
            budget -= n
        if not chosen:
            return None
        batch, self._decoded = self._build(chosen), None
        for req in batch.reqs:
            if req.remaining_prefill() == 0:
                self.waiting.remove(req)
                self.running.append(req)
        return batch

    def _decode_batch(self) -> ScheduledBatch | None:
        while self.running and not self.kv.can_allocate(len(self.running)):
            self.retract(max(self.running, key=lambda r: r.created))  # newest first
        if not self.running:
            return None
        reqs = sorted(self.running, key=lambda r: r.num_computed)  # NOTE: length-bucketed attention then pads little
        steady, self._decoded = reqs == self._decoded, reqs
        return self._build([(r, 1) for r in reqs], steady)

    def _build(self, chosen: list[tuple[Req, int]], steady: bool = False) -> ScheduledBatch:
        prefix = [r.num_computed for r, _ in chosen]
        new_ids = [r.ids(p, p + n) or [-1] for (r, n), p in zip(chosen, prefix)]  # (-1: a token still on the device)
        out = self.kv.allocate([(r.kv, n) for r, n in chosen], steady)
        return ScheduledBatch([r for r, _ in chosen], [r.kv.row for r, _ in chosen], prefix, new_ids, out, steady)

    def check_integrity(self) -> bool:
        assert self.kv.check_integrity()
        held = sum(r.kv is not None for r in self.requests())
        assert held == self.kv.num_live(), f"{self.kv.num_live()} live KV records for {held} queued requests"
        return True
