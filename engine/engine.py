"""The engine the server drives: `add_request`, `abort`, `step` -> outputs for each touched request.

`add_request` and `abort` may be called from any thread (they validate, then hand over through a
locked inbox); everything else runs on the one thread that calls `step`.
"""

from __future__ import annotations

import threading
import uuid

import torch

from engine.engine_args import EngineArgs
from engine.logprobs import logprob_entries
from engine.request import LogprobOptions, Req, RequestOutput
from engine.sampling import Sampler, SamplingParams
from engine.scheduler import ScheduledBatch, Scheduler
from engine.setup import build_components
from engine.stop import StopChecker

ABORT_WAITING = "Abort in waiting queue"


class Engine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        c = build_components(args)
        self.model, self.tokenizer, self.runner, self.radix = c.model, c.tokenizer, c.runner, c.radix
        self.cfg, self.context_len = c.model.cfg, c.context_len
        self.scheduler = Scheduler(self.runner, self.radix, args.max_running_requests, args.chunked_prefill_size)
        self.sampler = Sampler()
        self.eos_ids = set(self.cfg.eos_token_ids) | (self.tokenizer.eos_token_ids if self.tokenizer else set())
        self.max_total_len = min(self.context_len, self.runner.allocator.size)
        self._seeds = torch.Generator().manual_seed(args.random_seed)
        self._lock = threading.Lock()
        self._inbox: list[Req] = []
        self._aborts: list[tuple[str, bool]] = []
        self._touched: dict[str, Req] = {}
        self._hidden: set[str] = set()
        self._groups: dict[str, list[str]] = {}  # rid of an n > 1 request -> the rids it expanded into
        self._step_lock = threading.Lock()  # held while a step runs: maintenance waits for it
        self.fault_hook = None  # tests: callable(req) raising to simulate a per-request engine failure

    # ---- submission (any thread) ------------------------------------------------------------
    def validate(self, prompt_ids: list[int], params: SamplingParams, logprob: LogprobOptions) -> None:
        """Raise ValueError (message for the client) if this request cannot be served."""
        if not prompt_ids:
            raise ValueError("input_ids cannot be empty.")
        bad = [t for t in prompt_ids if not (0 <= t < self.cfg.vocab_size)]
        if bad:
            raise ValueError(f"input_ids must be in [0, {self.cfg.vocab_size - 1}], got {bad[0]}.")
        if len(prompt_ids) >= self.context_len:
            raise ValueError(f"The input ({len(prompt_ids)} tokens) is longer than the model's context length "
                             f"({self.context_len} tokens).")
        if len(prompt_ids) + 1 > self.runner.allocator.size:
            raise ValueError(f"The input ({len(prompt_ids)} tokens) does not fit in the KV cache "
                             f"({self.runner.allocator.size} tokens); raise --max-total-tokens.")
        params.verify(self.cfg.vocab_size)
        if logprob.logprob_start_len >= len(prompt_ids):
            raise ValueError(f"logprob_start_len ({logprob.logprob_start_len}) is higher than the number of "
                             f"input tokens ({len(prompt_ids)}). Request with a lower logprob_start_len.")
        if logprob.top_logprobs_num < 0:
            raise ValueError(f"top_logprobs_num must be at least 0, got {logprob.top_logprobs_num}.")
        for t in logprob.token_ids_logprob or ():
            if not 0 <= t < self.cfg.vocab_size:
                raise ValueError(f"token_ids_logprob must be in [0, {self.cfg.vocab_size - 1}], got {t}.")

    def add_request(self, prompt_ids: list[int], params: SamplingParams, logprob: LogprobOptions | None = None,
                    rid: str | None = None) -> list[str]:
        """Queue a request (n > 1: n samples sharing one prefill); returns the rid of each sample."""
        logprob = logprob or LogprobOptions()
        self.validate(prompt_ids, params, logprob)
        rid = rid or uuid.uuid4().hex
        reqs, parent = [], None
        n = params.n
        if n > 1 and not self.args.disable_radix_cache:
            parent = self._make_req(f"{rid}__prefill", prompt_ids, params.derive(max_new_tokens=0, n=1), LogprobOptions())
            reqs.append(parent)
        for i in range(n):
            seed = None if params.sampling_seed is None else params.sampling_seed + i
            sub = self._make_req(rid if n == 1 else f"{rid}_{i}", prompt_ids, params.derive(n=1, sampling_seed=seed), logprob)
            sub.depends_on = parent
            reqs.append(sub)
        samples = [r.rid for r in reqs if r is not parent]
        with self._lock:
            if parent is not None:
                self._hidden.add(parent.rid)
            if n > 1:
                self._groups[rid] = [r.rid for r in reqs]
            self._inbox.extend(reqs)
        return samples

    def _make_req(self, rid: str, prompt_ids: list[int], params: SamplingParams, logprob: LogprobOptions) -> Req:
        seed = params.sampling_seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        gen = torch.Generator(device=self.runner.device).manual_seed(seed)
        stop = StopChecker(params, self.eos_ids, self.tokenizer, prompt_ids, self.max_total_len)
        return Req(rid, list(prompt_ids), params, logprob, gen, stop)

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        with self._lock:
            self._aborts.append((rid, abort_all))

    # ---- the engine thread ------------------------------------------------------------------
    def has_work(self) -> bool:
        with self._lock:
            return bool(self._inbox or self._aborts or self.scheduler.has_work())

    def step(self) -> list[RequestOutput]:
        """One scheduling step: take new requests and aborts, run one batch, report what changed."""
        with self._step_lock:
            self._drain_inbox()
            batch = self.scheduler.next_batch()
            if batch is not None:
                self._run(batch)
            return self._collect()

    def _drain_inbox(self) -> None:
        with self._lock:
            new, aborts = self._inbox, self._aborts
            self._inbox, self._aborts = [], []
        for req in new:
            self.scheduler.add(req)
        for rid, everything in aborts:
            targets = set(self._groups.get(rid, [rid]))  # an n > 1 request aborts all its samples
            for req in [r for r in (*self.scheduler.waiting, *self.scheduler.running)
                        if everything or r.rid in targets]:
                waiting = req.row < 0
                self._end(req, {"type": "abort", "message": ABORT_WAITING if waiting else "Aborted by request.",
                                "status_code": None})

    def _end(self, req: Req, reason: dict, error: str | None = None) -> None:
        req.finish(reason)
        req.error = error
        req.stop.abort()
        self.scheduler.release(req)
        self._touched[req.rid] = req

    def _run(self, batch: ScheduledBatch) -> None:
        fb = self.runner.build_batch(batch.items, batch.out_cache_loc)
        rows, prompt_plan, samplers = [], [], []
        offset = 0
        for req, item in zip(batch.reqs, batch.items):
            n = len(item.new_ids)
            prompt_plan.append(self._prompt_logprob_rows(req, item.prefix_len, n, offset, rows))
            if req.remaining_prefill() == 0:
                samplers.append((req, len(rows)))
                rows.append(offset + n - 1)
            offset += n
        logits = self.runner.forward(fb, torch.tensor(rows, dtype=torch.int64, device=self.runner.device))
        for req, (first, targets, null_first) in zip(batch.reqs, prompt_plan):
            if targets or null_first:
                self._record_prompt_logprobs(req, logits[first:first + len(targets)], targets, null_first)
        self._sample([r for r, _ in samplers], logits[[i for _, i in samplers]] if samplers else None)

    def _prompt_logprob_rows(self, req: Req, c0: int, n: int, offset: int, rows: list[int]) -> tuple[int, list[int], bool]:
        """Rows whose logits score prompt tokens in this chunk: (first row index, target ids, null entry)."""
        lp, p = req.logprob, len(req.prompt_ids)
        if not lp.return_logprob or lp.logprob_start_len < 0 or req.prompt_logprobs_done:
            return len(rows), [], False
        c1 = c0 + n
        first = len(rows)
        lo, hi = max(c0, lp.logprob_start_len - 1), min(c1, p - 1)
        targets = []
        for j in range(lo, hi):
            rows.append(offset + j - c0)
            targets.append(req.prompt_ids[j + 1])
        if c1 >= p:
            req.prompt_logprobs_done = True
        return first, targets, c0 == 0 and lp.logprob_start_len == 0

    def _record_prompt_logprobs(self, req: Req, logits: torch.Tensor, targets: list[int], null_first: bool) -> None:
        out = req.logprobs
        if null_first:
            out.input_token.append((None, req.prompt_ids[0]))
            out.input_top.append(None)
            out.input_ids.append(None)
        if targets:
            tok, top, ids = logprob_entries(logits, targets, req.logprob.top_logprobs_num, req.logprob.token_ids_logprob)
            out.input_token.extend(tok)
            out.input_top.extend(top or [None] * len(tok))
            out.input_ids.extend(ids or [None] * len(tok))

    def _sample(self, reqs: list[Req], logits: torch.Tensor | None) -> None:
        live = []
        for i, req in enumerate(reqs):
            if self.fault_hook is not None:
                try:
                    self.fault_hook(req)
                except Exception as e:  # one request fails, the batch goes on
                    self._end(req, {"type": "abort", "message": f"internal error: {e}", "status_code": 500}, str(e))
                    continue
            if req.params.max_new_tokens == 0:
                self._end_normally(req, {"type": "length", "length": 0})
            else:
                live.append(i)
        if not live:
            return
        reqs, logits = [reqs[i] for i in live], logits[live]
        suppress = [r.stop.suppressed(len(r.output_ids)) for r in reqs]
        tokens = self.sampler.sample(logits, [r.params for r in reqs], [r.output_ids for r in reqs],
                                     [r.prompt_ids for r in reqs], [r.generator for r in reqs], suppress).tolist()
        for req, row, tok in zip(reqs, logits, tokens):
            if req.logprob.return_logprob:
                lp = req.logprob
                t, top, ids = logprob_entries(row[None], [tok], lp.top_logprobs_num, lp.token_ids_logprob)
                req.logprobs.output_token.extend(t)
                if top:
                    req.logprobs.output_top.extend(top)
                if ids:
                    req.logprobs.output_ids.extend(ids)
            req.output_ids.append(tok)
            self._touched[req.rid] = req
            reason = req.stop.on_token(tok, len(req.output_ids), len(req.prompt_ids) + len(req.output_ids))
            if reason is not None:
                self._end_normally(req, reason)

    def _end_normally(self, req: Req, reason: dict) -> None:
        req.finish(reason)
        self.scheduler.release(req)
        self._touched[req.rid] = req

    def _collect(self) -> list[RequestOutput]:
        outs = []
        for rid, req in self._touched.items():
            if rid in self._hidden:
                if req.finished:
                    self._hidden.discard(rid)
                continue
            if req.finished:
                self._forget_group(rid)
            new = req.output_ids[req.sent_ids:]
            req.sent_ids = len(req.output_ids)
            outs.append(RequestOutput(
                rid=rid, new_ids=new, output_ids=list(req.output_ids), text=req.stop.released_text(),
                finished=req.finished, finish_reason=req.finish_reason, prompt_tokens=len(req.prompt_ids),
                cached_tokens=req.cached_tokens, logprobs=req.logprobs.snapshot() if req.logprob.return_logprob else None,
                num_retractions=req.num_retractions, error=req.error))
        self._touched = {}
        return outs

    def _forget_group(self, rid: str) -> None:
        base = rid.rsplit("_", 1)[0]
        group = self._groups.get(base)
        if group and all(self.scheduler.find(r) is None for r in group if r != rid):
            del self._groups[base]

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every queued and running request with an error (after a failed step); report them."""
        with self._lock:
            new, self._inbox = self._inbox, []
        for req in new:
            self.scheduler.add(req)
        for req in [*self.scheduler.waiting, *self.scheduler.running]:
            self._end(req, {"type": "abort", "message": message, "status_code": 500}, message)
        return self._collect()

    # ---- maintenance ------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        """Drop the prefix cache; refused (False) while requests are queued or running.

        Safe from any thread: it waits for a running step to end, so no request is mid-release.
        """
        with self._step_lock:
            if self.has_work():
                return False
            self.radix.flush()
            return True

    def check_integrity(self) -> bool:
        return self.scheduler.check_integrity()

    def integrity_ok(self) -> bool:
        """`check_integrity()` from any thread: waits for a running step to end; False instead of raising."""
        with self._step_lock:
            try:
                return self.check_integrity()
            except AssertionError:
                return False
