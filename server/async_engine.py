"""The bridge between the asyncio event loop and the engine thread: `submit` queues requests in the engine (its
validation's ValueError is the client's BadRequest) and opens one `Channel` for their samples; the engine thread sleeps
until there is work, runs `Engine.step()` and hands each output to its channel with `call_soon_threadsafe`. NOTE: the
engine thread is the only one that runs torch: it builds the engine, warms it up and steps it. libgomp gives each thread
running a parallel region an OpenMP pool of its own, and once the pools hold more threads than there are CPUs its
workers stop spin-waiting between regions, so each region pays a futex wake-up: a model built on the main thread and
stepped on this one ran every small parallel op ~1.8x slower (measured: a 200k-element add, 20 -> 37 us)."""

import asyncio
import gc
import logging
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from contextlib import suppress
from typing import Any

from engine.runtime.engine import Engine
from engine.runtime.request import NewRequest, RequestOutput
from server.errors import BadRequest

logger = logging.getLogger(__name__)

MAX_BACKLOG = 64  # outputs a Channel queues before it merges (a client that stops reading costs bounded memory)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped (or the server is shutting down); no request can be served."""


def merge(a: RequestOutput, b: RequestOutput) -> RequestOutput:
    """One output carrying the deltas of `a` then `b` (and `b`'s counts and finish)."""
    if (lp := a.logprobs) is not None and b.logprobs is not None:
        lp.extend(b.logprobs)
    return RequestOutput(b.rid, a.new_ids + b.new_ids, a.new_text + b.new_text, lp, b.completion_tokens,
                         b.prompt_tokens, b.cached_tokens, b.finished, b.finish_reason, b.num_retractions, b.error)


class Channel:
    """The outputs of one submission's sequences not yet read by its one reader, in arrival order, as (sequence index,
    output). Past `limit` queued items a new output is merged into the last queued one of its sequence (outputs are
    deltas: merging keeps everything), so at most `limit` + (number of sequences) items are ever held."""

    def __init__(self, limit: int = MAX_BACKLOG) -> None:
        self.limit, self._ready = limit, asyncio.Event()
        self._items: deque[tuple[int, RequestOutput]] = deque()
        self.quiet = False  # a result-only reader: woken at a finish or a full queue, not each step (-18% latency)

    def __len__(self) -> int:
        return len(self._items)

    def put_nowait(self, idx: int, out: RequestOutput) -> None:
        if not self.quiet or out.finished or len(self._items) + 1 >= self.limit:
            self._ready.set()
        if len(self._items) >= self.limit:
            for j in range(len(self._items) - 1, -1, -1):
                if self._items[j][0] == idx:
                    self._items[j] = (idx, merge(self._items[j][1], out))
                    return
        self._items.append((idx, out))

    async def get(self) -> tuple[int, RequestOutput]:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        return self._items.popleft()


class AsyncEngine:
    def __init__(self, build: Callable[[], Engine], max_sequences: int | None = None) -> None:
        """Start the engine thread, building the engine there (its errors raise here); it steps once `start` runs."""
        built: Future[Engine] = Future()
        self._go = threading.Event()

        def main() -> None:
            try:
                built.set_result(build())
            except BaseException as e:  # noqa: BLE001 - re-raised on the caller's thread
                built.set_exception(e)
                return
            self._go.wait()
            if not self._stop.is_set():
                self._run()

        self._stop, self._thread = threading.Event(), threading.Thread(target=main, name="engine", daemon=True)
        self._thread.start()
        self.engine = built.result()
        self.max_sequences = max_sequences  # samples one submit may queue (--max-batch-size)
        self.observer: Callable[[RequestOutput, float], None] | None = None  # sees every output (metrics)
        self.on_submit: Callable[[list[str], float], None] | None = None  # accepted rids, arrival time (metrics)
        self.accepting = True
        self._routes: dict[str, tuple[Channel, int]] = {}  # rid of a live sample -> its reader, its index
        self._idle = asyncio.Event()  # set while no route is open (drain waits on it)
        self._idle.set()
        self._drain: asyncio.Future | None = None
        self._calls: deque[tuple[Callable[[], Any], Future]] = deque()  # for the engine thread, between steps
        self._loop: asyncio.AbstractEventLoop | None = None
        self.warming = True  # until the engine thread has compiled or captured its decode graphs

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._go.set()

    def stop(self) -> None:
        self._stop.set()
        self._go.set()
        self.engine.wake()
        self._thread.join(timeout=10)
        gc.unfreeze()  # (what the warm-up froze is the collector's again: an embedding process goes on)
        while self._calls:
            if (done := self._calls.popleft()[1]).set_running_or_notify_cancel():
                done.set_exception(EngineDeadError("the engine has stopped"))

    @property
    def alive(self) -> bool:
        return self._go.is_set() and self._thread.is_alive()

    def num_in_flight(self) -> int:
        return len(self._routes)

    def num_pending_outputs(self) -> int:
        """Outputs produced but not yet read by their readers (bounded per reader)."""
        return sum(len(c) for c in {id(c): c for c, _ in self._routes.values()}.values())

    def _run(self) -> None:
        try:
            self.engine.warm_up()
        except Exception:
            logger.exception("decode graph warm-up failed: decoding eager")
        # NOTE: startup's heap out of the collector's full passes, which scanned it all: a 160-175 ms pause, the engine
        # stopped, about once a burst of 64 requests x 256 tokens (bench/simulated_gpu.py: a 2 ms-a-step device)
        gc.collect()
        gc.freeze()
        self.warming = False
        while not self._stop.is_set():
            work = self.engine.wait_for_work()
            while self._calls:
                fn, done = self._calls.popleft()
                if done.set_running_or_notify_cancel():  # (else its caller gave up: not run)
                    try:
                        done.set_result(fn())
                    except Exception as e:  # noqa: BLE001 - raised in the caller
                        done.set_exception(e)
            if not work:
                continue
            try:
                outs = self.engine.step()
            except Exception as e:  # the batch is lost: fail its requests, keep serving the rest
                logger.exception("engine step failed")
                try:
                    outs = self.engine.fail_all(f"internal error in the engine: {e}")
                except Exception:  # (a sticky CUDA error: nothing runs) every request ends here, the thread stops
                    logger.exception("the engine cannot recover: it stops (/health 503)")
                    self._go.clear()  # (not alive from here: no call or request is queued behind this)
                    self._loop.call_soon_threadsafe(self._end_all, f"the engine stopped after an error: {e}")
                    return
            if outs and self._loop is not None:
                self._loop.call_soon_threadsafe(self._dispatch, outs)

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        now = time.monotonic()
        for out in outs:
            if self.observer is not None:
                self.observer(out, now)
            if (route := self._routes.get(out.rid)) is not None:
                route[0].put_nowait(route[1], out)
                if out.finished:
                    del self._routes[out.rid]
                    if not self._routes:
                        self._idle.set()

    def _end_all(self, message: str) -> None:
        """The engine thread stopped: every queued call fails (EngineDeadError), every open request ends (500)."""
        self.stop()
        reason = {"type": "abort", "message": message, "status_code": 500}
        self._dispatch([RequestOutput(r, [], "", None, 0, 0, 0, True, reason, error=message) for r in list(self._routes)])

    def submit(self, reqs: list[NewRequest]) -> tuple[list[str], Channel]:
        """Queue every request or none (BadRequest for the client). Returns every sample's rid (request
        by request, n samples each) and the channel their outputs arrive on, indexed in that order."""
        if not self.accepting:
            raise EngineDeadError("the server is shutting down")
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        try:
            rids = [r for group in self.engine.add_requests(reqs, self.max_sequences) for r in group]
        except ValueError as e:  # add_requests validates and queues: its ValueError is the request's fault
            raise BadRequest(str(e)) from None
        channel = Channel()
        self._routes.update({r: (channel, i) for i, r in enumerate(rids)})
        self._idle.clear()
        if self.on_submit is not None:
            self.on_submit(rids, time.monotonic())
        return rids, channel

    def abort(self, rid: str = "", abort_all: bool = False) -> None:
        self.engine.abort(rid, abort_all)

    async def on_engine_thread(self, fn: Callable[[], Any]) -> Any:
        """`fn()` run on the engine thread between two steps (it is the only thread that runs torch)."""
        if not self.alive:
            raise EngineDeadError("the engine is not running")
        done: Future = Future()
        self._calls.append((fn, done))
        self.engine.wake()
        return await asyncio.wrap_future(done)

    async def check_integrity(self) -> bool | None:
        """`Engine.check_integrity` (False where it fails) on the engine thread; None while warming up or stopped."""
        return None if self.warming or not self.alive else await self.on_engine_thread(self._integrity_ok)

    def _integrity_ok(self) -> bool:
        if threading.current_thread() is not self._thread:  # the check runs torch
            raise RuntimeError("the integrity check runs on the engine thread only")
        try:
            return self.engine.check_integrity()
        except AssertionError:
            return False

    def drain(self, grace: float) -> Awaitable[None]:
        """Stop accepting; let in-flight requests finish for up to `grace` s, then abort the rest (5 s more to
        end). Woken by the last request's end, no polling; it runs once (a second call waits for the first)."""
        self.accepting = False
        if self._drain is None:
            self._drain = asyncio.ensure_future(self._drained(grace))
        return asyncio.shield(self._drain)

    async def _drained(self, grace: float) -> None:
        try:
            await asyncio.wait_for(self._idle.wait(), grace)
        except asyncio.TimeoutError:
            self.abort(abort_all=True)
            with suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._idle.wait(), 5)
