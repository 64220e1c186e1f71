"""The engine: `add_requests`, `abort`, `stats`, `wait_for_work` (any thread) and `step` (the engine thread only: take
new requests and aborts, schedule, run, sample, read tokens back) -> a delta for each touched request; `flush_cache` and
`check_integrity` run torch: the engine thread too, between steps. Overlapped (CUDA, SGLang's overlap schedule), a
steady decode step is launched before the last step's tokens are read back, the host working on them as the device
computes; a request a read-back token ends has a token computed ahead, dropped. (On CPU overlap would only delay.)"""

import random
import threading
import uuid
from dataclasses import replace

import torch

from engine.runtime.engine_args import EngineArgs
from engine.runtime.logprobs import plan_prompt_rows, record_output, record_prompt
from engine.runtime.model_runner import ModelRunner, take_rows
from engine.runtime.request import Limits, NewRequest, Req, RequestOutput, validate
from engine.runtime.rids import RidTable
from engine.runtime.sampler import Sampler
from engine.runtime.sampling_params import SamplingParams
from engine.runtime.scheduler import ScheduledBatch, Scheduler
from engine.runtime.setup import build_components
from engine.runtime.stats import EngineStats
from engine.runtime.stop import StopChecker


class Engine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        model, self.tokenizer, self.pool, self._kv, self.context_len = build_components(args)
        self.cfg, self.max_total_len = model.cfg, min(self.context_len, self._kv.size)
        self._runner = ModelRunner(model, self.pool, args, self.max_total_len)
        chunk = args.chunked_prefill_size or (8192 if self._runner.device.type == "cuda" else 2048)
        self._scheduler, self._sampler = Scheduler(self._kv, args.max_running_requests, chunk), Sampler()
        self.eos_ids = set(self.cfg.eos_token_ids) | (self.tokenizer.eos_token_ids if self.tokenizer else set())
        self.limits = Limits(self.cfg.vocab_size, self.context_len, self._kv.size, args.max_new_tokens_cap,
                             self.tokenizer is not None)
        self._seeds = random.Random(args.random_seed)  # an unseeded request's seed
        self._cond = threading.Condition()  # guards the inbox, the aborts and the rid tables
        self._inbox: list[tuple[NewRequest, str]] = []
        self._aborts: list[tuple[str, bool]] = []
        self._woken, self._rids = False, RidTable()
        self._touched: dict[str, Req] = {}
        self._overlap = self._runner.device.type == "cuda" and not args.disable_overlap_schedule
        self._pending: tuple | None = None  # the last step's (requests, logprob layout, ids or table to the host, event)
        self.overlapped_steps = 0  # (steps launched before the last one's tokens were read back)

    def add_requests(self, reqs: list[NewRequest], max_sequences: int | None = None) -> list[list[str]]:
        """Validate every request, then queue them all (all or nothing); the rids of each one's samples.
        `max_sequences` bounds the samples of the whole call (the server's --max-batch-size)."""
        for r in reqs:
            validate(r, self.limits)
        if max_sequences is not None and (total := sum(r.params.n for r in reqs)) > max_sequences:
            raise ValueError(f"This request asks for {total} sequences ({len(reqs)} prompts x n={reqs[0].params.n}); "
                             f"this server allows at most {max_sequences} per request (--max-batch-size).")
        with self._cond:
            rids = [r.rid or uuid.uuid4().hex for r in reqs]
            out = self._rids.add(rids, [r.params.n for r in reqs])
            self._inbox.extend(zip(reqs, rids))
            self._cond.notify_all()
        return out

    def _expand(self, r: NewRequest, rid: str) -> None:
        """Queue one request (engine thread): n samples, sharing one hidden prefill when the prefix
        cache is on. NOTE: built here, not by the caller, so only the engine thread runs torch."""
        n, parent = r.params.n, None
        if n > 1 and not self.args.disable_radix_cache:
            parent = self._queue(f"{rid}__prefill", r, replace(r.params, max_new_tokens=0, n=1), hidden=True)
        for i in range(n):
            seed = None if r.params.sampling_seed is None else r.params.sampling_seed + i
            self._queue(rid if n == 1 else f"{rid}_{i}", r, replace(r.params, n=1, sampling_seed=seed), parent)

    def _queue(self, rid: str, r: NewRequest, params, parent: Req | None = None, hidden: bool = False) -> Req:
        seed = self._seeds.getrandbits(62) if params.sampling_seed is None else params.sampling_seed
        stop = StopChecker(params, self.eos_ids, self.tokenizer, r.prompt_ids, self.max_total_len)
        logprob = r.logprob if not hidden else type(r.logprob)()
        self._scheduler.add(req := Req(rid, list(r.prompt_ids), params, logprob, seed, stop, depends_on=parent,
                                       hidden=hidden))
        return req

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        with self._cond:
            self._aborts.append((rid, abort_all))
            self._cond.notify_all()

    def warm_up(self) -> None:
        """Compile or capture the decode graphs (if enabled) and draw once (CUDA: the race kernel built); before serving."""
        self._runner.graphs.warm_up()
        logits = torch.zeros(1, self.cfg.vocab_size, device=self._runner.device)
        Sampler().sample(logits, [SamplingParams()], [[]], [[0]], [0])

    def has_work(self) -> bool:
        with self._cond:
            return bool(self._inbox or self._aborts or self._scheduler.has_work())

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Sleep until there is work (or `wake()`); no polling. True when there is work."""
        with self._cond:
            self._cond.wait_for(lambda: self._woken or self.has_work(), timeout)  # NOTE: the lock is re-entrant
            self._woken = False
            return self.has_work()

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify_all()

    def step(self) -> list[RequestOutput]:
        self._drain_inbox()
        if not (self._overlap and self._scheduler.steady_next()):
            self._read_back()  # (the next step needs every request as it is)
        self.overlapped_steps += self._pending is not None
        batch = self._scheduler.next_batch()
        launched = self._run(batch) if batch is not None else None
        self._read_back()  # (overlapped: the last step's tokens, while the device computes this one)
        self._pending = launched
        if not self._overlap or (launched and all(r.finished for r in launched[0])):
            self._read_back()  # (off; or only tokens computed ahead, dropped without waiting for them)
        return self._collect()

    def _drain_inbox(self) -> None:
        with self._cond:
            new, aborts, self._inbox, self._aborts = self._inbox, self._aborts, [], []
        for r, rid in new:
            self._expand(r, rid)
        for rid, everything in aborts:
            targets = self._rids.group.get(rid, [rid])  # (an n > 1 request: all its samples)
            for req in [r for r in self._scheduler.requests() if everything or r.rid in targets]:
                message = "Abort in waiting queue" if req.kv is None else "Aborted by request."
                self._end(req, {"type": "abort", "message": message, "status_code": None})

    def _end(self, req: Req, reason: dict, error: str | None = None, cache: bool = True) -> None:
        req.finish(reason, error)
        req.stop.finish(None)
        self._scheduler.release(req, cache)
        self._touched[req.rid] = req

    def _run(self, batch: ScheduledBatch) -> tuple | None:
        rows, plans, sampling, offset = [], [], [], 0
        for req, prefix, ids in zip(batch.reqs, batch.prefix_lens, batch.new_ids):
            plans.append(plan_prompt_rows(req, prefix, len(ids), offset, rows))
            if req.remaining_prefill() == 0:
                sampling.append((req, len(rows)))
                rows.append(offset + len(ids) - 1)
            offset += len(ids)
        logits = self._runner.forward(batch, self._kv.table, rows)
        for req, plan in zip(batch.reqs, plans):
            record_prompt(req, plan, logits)  # (if any: reported with the request's next output)
        return self._sample([r for r, _ in sampling], take_rows(logits, [i for _, i in sampling]),
                            batch.steady) if sampling else None

    def _sample(self, reqs: list[Req], logits: torch.Tensor, steady: bool) -> tuple | None:
        """Sample the requests' next tokens on the device; what `_read_back` takes (nothing is read here)."""
        for r in (r for r in reqs if r.params.max_new_tokens == 0):
            self._end(r, {"type": "length", "length": 0})
        if not (live := [i for i, r in enumerate(reqs) if r.params.max_new_tokens != 0]):
            return None
        reqs, logits = [reqs[i] for i in live], take_rows(logits, live)
        suppress = [r.stop.suppressed(len(r.output_ids) + r.inflight) for r in reqs]
        tokens = self._sampler.sample(logits, [r.params for r in reqs], [r.output_ids for r in reqs],
                                      [r.prompt_ids for r in reqs], [r.seed for r in reqs], suppress, steady)
        for r in reqs:
            r.inflight += 1
        lp = [r.logprob for r in reqs if r.logprob.return_logprob]  # (their logprobs come back with the tokens)
        layout = (min(max(o.top_logprobs_num for o in lp), logits.shape[1]),
                  sorted({i for o in lp for i in o.token_ids_logprob or ()})) if lp else None
        table = self._sampler.logprob_table(logits, tokens, *layout) if layout else None
        return reqs, layout, *self._runner.sampled(tokens, table)

    def _read_back(self) -> None:
        """Accept the pending step's tokens (the step's one device-to-host copy, waited for here), if there is one."""
        if self._pending is None:
            return
        (reqs, layout, ids, ready), self._pending = self._pending, None
        if ready is not None and not all(r.finished for r in reqs):
            ready.synchronize()
        for req, row in zip(reqs, ids.tolist()):  # (each a token id, or a logprob table's row: see _sample)
            tok = row if layout is None else int(row[0])
            req.inflight -= 1
            if req.finished:  # (ended by the token before: this one was computed ahead, and is dropped)
                continue
            try:
                reason = self._accept(req, tok, row, layout)
            except Exception as e:  # one request's failure (detokenizing, logprobs) ends only it; KV not cached: its
                self._end(req, {"type": "abort", "message": f"internal error: {e}", "status_code": 500}, str(e), False)
                continue  # (last token may be unrecorded, with its slot computed ahead)
            if reason is not None:
                self._end(req, reason)

    def _accept(self, req: Req, tok: int, row: list[float] | int, layout: tuple | None) -> dict | None:
        """Record a sampled token (logprobs, output, stop checks); the finish reason if it ends the request."""
        if req.logprob.return_logprob:
            record_output(req, row, *layout)
        req.output_ids.append(tok)
        self._touched[req.rid] = req
        return req.stop.on_token(tok, len(req.output_ids), len(req.prompt_ids) + len(req.output_ids))

    def _collect(self) -> list[RequestOutput]:
        outs = [req.take_output() for req in self._touched.values() if not req.hidden]
        finished, self._touched = [r.rid for r in self._touched.values() if r.finished], {}
        if finished:
            with self._cond:
                self._rids.finished(finished)
        return outs

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End all queued and running requests with an error (a failed step). NOTE: KV not cached (maybe unwritten)."""
        self._pending = None
        self._drain_inbox()
        for req in self._scheduler.requests():
            self._end(req, {"type": "abort", "message": message, "status_code": 500}, message, cache=False)
        return self._collect()

    def stats(self) -> EngineStats:
        s, kv = self._scheduler, self._kv
        return EngineStats(len(s.running), len(s.waiting), kv.size, kv.size - kv.free_slots(), kv.free_slots(),
                           kv.evictable_slots(), kv.cached_slots(), self.pool.total_bytes(),
                           self._runner.graphs.ready(), dict(kv.hit_tokens), kv.hicache.info() if kv.hicache else None)

    def decode_graphs(self) -> dict:
        return self._runner.graphs.info() | {"overlapped_steps": self.overlapped_steps}

    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests run or wait."""
        return not self.has_work() and self._kv.flush()

    def check_integrity(self) -> bool:
        return self._scheduler.check_integrity()
