"""The scheduler over a real KV cache manager and no model: admission, chunking, retraction, eviction
and abort, with `check_integrity()` after every step. A stand-in "model" appends one token per request
that finished its prefill, as the engine's sampler would."""

from __future__ import annotations

import random
import subprocess
import sys

from engine.runtime.request import LogprobOptions, Req
from engine.runtime.sampling_params import SamplingParams
from engine.runtime.scheduler import Scheduler
from engine.runtime.stop import StopChecker
from mem_cache import KVCacheManager


def make_req(rid: str, prompt: list[int], max_new: int) -> Req:
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    return Req(rid, prompt, params, LogprobOptions(), 0, StopChecker(params, set(), None, prompt, 10**6))


class Loop:
    """Schedule -> fake forward (one token per request that completes its prefill) -> release finished."""

    def __init__(self, size: int, max_running: int, chunk: int, radix: bool = True) -> None:
        self.kv = KVCacheManager(size, max_running, 4096, disable_radix_cache=not radix)
        self.sched = Scheduler(self.kv, max_running, chunk)
        self.done: list[Req] = []
        self.steps = []  # (is decode, tokens fed) per step

    def step(self) -> None:
        batch = self.sched.next_batch()
        assert batch is not None
        fed = sum(len(x) for x in batch.new_ids)
        assert len(batch.out_cache_loc) == fed and len(set(batch.out_cache_loc.tolist())) == fed
        start = 0
        for req, prefix, ids in zip(batch.reqs, batch.prefix_lens, batch.new_ids):
            assert prefix + len(ids) == req.num_computed
            own = batch.out_cache_loc[start:start + len(ids)].tolist()  # this step's slots, at their positions
            assert self.kv.slots(req.kv)[prefix:].tolist() == own
            start += len(ids)
        self.steps.append((all(len(x) == 1 for x in batch.new_ids) and batch.reqs[0] in self.sched.running, fed))
        for req in batch.reqs:
            if req.remaining_prefill() == 0:
                req.output_ids.append(7)
                if req.stop.on_token(7, len(req.output_ids), len(req.all_ids)) is not None:
                    req.finish({"type": "length"})
                    self.sched.release(req)
                    self.done.append(req)
        assert self.sched.check_integrity()

    def run(self) -> None:
        while self.sched.has_work():
            self.step()


def test_chunked_prefill_respects_the_token_budget_and_finishes_every_request() -> None:
    loop = Loop(size=4096, max_running=8, chunk=64)
    for i, n in enumerate((300, 5, 130, 64)):
        loop.sched.add(make_req(f"r{i}", list(range(1, n + 1)), max_new=3))
    loop.run()
    assert sorted(r.rid for r in loop.done) == ["r0", "r1", "r2", "r3"]
    assert all(fed <= 64 for decode, fed in loop.steps if not decode)
    assert all(len(r.output_ids) == 3 for r in loop.done)
    assert loop.kv.free_slots() + loop.kv.cached_slots() == 4096


def test_admission_is_capped_by_max_running() -> None:
    loop = Loop(size=4096, max_running=2, chunk=4096)
    for i in range(5):
        loop.sched.add(make_req(f"r{i}", [1, 2, 3], max_new=4))
    loop.step()
    assert len(loop.sched.running) == 2 and len(loop.sched.waiting) == 3
    loop.run()
    assert len(loop.done) == 5


def test_a_small_pool_retracts_and_still_finishes_everything() -> None:
    rng = random.Random(0)
    loop = Loop(size=400, max_running=16, chunk=256, radix=False)
    for i in range(12):
        loop.sched.add(make_req(f"r{i}", [rng.randrange(1, 50) for _ in range(rng.randint(20, 60))], max_new=40))
    loop.run()
    assert len(loop.done) == 12 and sum(r.num_retractions for r in loop.done) > 0
    assert loop.kv.free_slots() == 400 and loop.kv.num_live() == 0


def test_prefix_cache_hits_and_eviction_under_pressure() -> None:
    loop = Loop(size=300, max_running=4, chunk=512)
    shared = list(range(1, 101))
    loop.sched.add(make_req("first", shared + [500], max_new=2))
    loop.run()
    loop.sched.add(make_req("hit", shared + [501], max_new=2))
    loop.run()
    assert loop.done[-1].cached_tokens == 100
    for i in range(6):  # new families: the old prefix has to go
        loop.sched.add(make_req(f"f{i}", [1000 * (i + 1) + j for j in range(120)], max_new=2))
    loop.run()
    assert len(loop.done) == 8 and loop.kv.cached_slots() <= 300


def test_abort_waiting_and_running_frees_their_kv() -> None:
    loop = Loop(size=1000, max_running=2, chunk=4096)
    reqs = [make_req(f"r{i}", list(range(1, 101)), max_new=500) for i in range(3)]
    for r in reqs:
        loop.sched.add(r)
    for _ in range(3):
        loop.step()
    assert reqs[2].kv is None and reqs[0].kv is not None  # the third waits for a row
    for r in reqs:
        r.finish({"type": "abort"})
        loop.sched.release(r)
        assert loop.sched.check_integrity()
    assert not loop.sched.has_work() and loop.kv.num_live() == 0
    assert loop.kv.free_slots() + loop.kv.cached_slots() == 1000 and loop.kv.evictable_slots() == loop.kv.cached_slots()


def test_the_scheduler_imports_no_model_code() -> None:
    code = "import sys, engine.runtime.scheduler; print(sorted(m for m in sys.modules if m.startswith('engine.model')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_ids_is_a_slice_of_prompt_and_output():
    rng = random.Random(0)
    for _ in range(500):
        req = make_req("r", [rng.randrange(100) for _ in range(rng.randrange(1, 6))], 4)
        req.output_ids = [rng.randrange(100, 200) for _ in range(rng.randrange(6))]
        n = len(req.all_ids)
        start = rng.randrange(n + 1)
        end = rng.randrange(start, n + 3)
        assert req.ids(start, end) == req.all_ids[start:end]
