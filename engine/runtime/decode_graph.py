"""Decode steps as captured graphs, one per batch-size bucket (SGLang's `--cuda-graph-bs`).

A decode step is one function of fixed-shape tensors (`ModelRunner.decode_step` over a `DecodeBatch`) with no
host sync inside, compiled by inductor (CPU) or inductor plus CUDA graphs (`triton.cudagraphs`, what
`mode="reduce-overhead"` sets; one graph recorded per bucket and key length) twice: for batch 1, and with the
batch size dynamic for every other bucket (the key length is dynamic in both). A batch is padded up to the next
bucket (padding rows write and read only the pool's padding slot 0); one past the largest bucket runs eager.
Inductor keeps its compiled kernels on disk (`TORCHINDUCTOR_CACHE_DIR`, by default /tmp/torchinductor_<user>):
a second start compiles nothing again. On a first start (the cache missed) a CPU engine compiles its batch-1
graph in a child process, a twin engine with the same arguments (the same KV pool size too, for the same cache
keys), while it compiles the dynamic graph itself.
"""

from __future__ import annotations

import logging
import multiprocessing
import threading
import time
import types
from collections.abc import Callable

import torch

from engine.model.forward_batch import DecodeBatch
from engine.runtime.engine_args import EngineArgs
from engine.runtime.graph_passes import MatVecAsReduction

logger = logging.getLogger(__name__)

# The default buckets, as SGLang's list for --cuda-graph-bs starts; capped by --cuda-graph-max-bs.
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
CPU_MAX_BS = 64  # NOTE: CPU buckets past 64 rows would add compile time for steps that are compute-bound anyway


def graph_buckets(args: EngineArgs, device: torch.device) -> tuple[int, ...]:
    """The batch sizes to capture: --cuda-graph-bs, else the default list up to --cuda-graph-max-bs
    (default: --max-running-requests, at most CPU_MAX_BS on CPU)."""
    if args.cuda_graph_bs:
        return tuple(sorted(set(args.cuda_graph_bs)))
    top = args.cuda_graph_max_bs or min(args.max_running_requests, CPU_MAX_BS if device.type == "cpu" else 256)
    return tuple(b for b in DEFAULT_BUCKETS if b < top) + (top,)


class DecodeGraphs:
    def __init__(self, step: Callable[[DecodeBatch], torch.Tensor], buckets: tuple[int, ...],
                 device: torch.device, warm_up_keys: int, cache: list[torch.Tensor]) -> None:
        self.step, self.buckets, self.device, self.warm_up_keys = step, buckets, device, warm_up_keys
        self._compiled: set[int] = set()
        if not buckets:
            return
        # NOTE: no guards on the model's modules and parameters (they never change once loaded): the guard
        # check of a batch-1 step drops from 150 to 66 us. Safe because every frame is this engine's own.
        def options(**inductor: object) -> dict:  # (a fresh dict per call: torch.compile pops from it)
            return {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe, **inductor}

        if device.type == "cuda":
            for t in cache:  # NOTE: the pool is written in place: static addresses, or no CUDA graph
                torch._dynamo.mark_static_address(t)
            cudagraphs = options(**{"triton.cudagraphs": True})  # (mode="reduce-overhead", with the guard filter)
            self._one = self._many = torch.compile(_own_frame(step), fullgraph=True, options=cudagraphs)
            return
        # NOTE: two frames, two graphs: batch 1 (static; its matrix-vector products as inductor's own sums, see
        # graph_passes) with the C++ wrapper, which saves the Python launch overhead of ~150 kernel calls
        # (measured 4.4 -> 3.1 ms a step), and every other bucket (batch dynamic) without it: its kernels run
        # long enough, and it compiles ~20 s faster. The C++ wrapper is built apart from its kernels (the wrapper
        # at -O1): its cold compile 80 -> 71 s, the step no slower (2.1-2.5 ms either way, batch 1, 320 keys).
        self._one = torch.compile(_own_frame(step), fullgraph=True,
                                  options=options(cpp_wrapper=True, cpp_wrapper_build_separate=True,
                                                  post_grad_custom_post_pass=MatVecAsReduction()))
        self._many = torch.compile(_own_frame(step), fullgraph=True, options=options())

    def ready(self) -> tuple[int, ...]:
        return tuple(sorted(self._compiled))

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def warm_up(self, compile_beside: Callable[[tuple[int, ...]], multiprocessing.Process] | None = None) -> None:
        """Compile (and on CUDA capture) every bucket before serving; one log line per bucket.

        On CPU, given `compile_beside` (a child process that builds the same engine and compiles the buckets
        it is given into the on-disk cache): the dynamic graph compiles first, and if it misses the cache, the
        batch-1 graph compiles in the child meanwhile; this process then loads it from the cache. NOTE: each
        compile is one core's Python: side by side on 2 cores, a cold start's two take ~95 s instead of
        71 + 80 s. A warm start starts no child (it would only slow the loads, ~7 + 8 s, down).
        """
        order, watch = self.buckets, None
        if compile_beside is not None and self.device.type == "cpu" and self.buckets[:1] == (1,) and len(self.buckets) > 1:
            order, watch = self.buckets[1:] + (1,), CacheMissWatch(lambda: compile_beside((1,)))
        for i, b in enumerate(order):
            t = time.perf_counter()
            if b == 1 and watch is not None:
                watch.finish()
            self._call(b, pad(empty_decode(b, self.warm_up_keys, self.device), b))
            self._compiled.add(b)
            logger.info("decode graph %d/%d: batch %d ready in %.1f s", i + 1, len(self.buckets), b,
                        time.perf_counter() - t)

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        """Logits of every row: through the bucket's graph when there is one, else eager."""
        rows = batch.input_ids.shape[0]
        b = self.bucket(rows)
        if b is None or b not in self._compiled:
            return self.step(batch)
        return self._call(b, pad(batch, b))[:rows]

    @torch.no_grad()  # NOTE: always: a graph compiled under one grad mode is recompiled under the other
    def _call(self, b: int, batch: DecodeBatch) -> torch.Tensor:
        torch._dynamo.mark_dynamic(batch.key_slots, 1)
        if b == 1:  # NOTE: a dimension of size 1 cannot be dynamic: batch 1 has a graph of its own
            out = self._one(batch)
        else:
            for t in (batch.input_ids, batch.positions, batch.out_cache_loc, batch.key_slots):
                torch._dynamo.mark_dynamic(t, 0)
            out = self._many(batch)
        return out.clone() if self.device.type == "cuda" else out  # (a CUDA graph reuses its output)


class CacheMissWatch:
    """Starts a child process (`start()` returns it) once a compile in this process misses the on-disk cache
    (AOTAutograd's miss counter, looked at twice a second from a thread of its own); `finish()` stops looking
    and waits for the child, if one was started."""

    def __init__(self, start: Callable[[], multiprocessing.Process]) -> None:
        self._child: multiprocessing.Process | None = None
        self._done = threading.Event()
        misses = _cache_misses()

        def look() -> None:
            while not self._done.wait(0.5):
                if _cache_misses() > misses:
                    self._child = start()
                    return

        self._thread = threading.Thread(target=look, name="decode-graph-cache-watch", daemon=True)
        self._thread.start()

    def finish(self) -> None:
        self._done.set()
        self._thread.join()
        if self._child is not None:
            self._child.join()
            if self._child.exitcode != 0:
                logger.warning("the compile beside exited with %s: compiling here", self._child.exitcode)


def _cache_misses() -> int:
    return torch._dynamo.utils.counters["aot_autograd"]["autograd_cache_miss"]


def _own_frame(step: Callable[[DecodeBatch], torch.Tensor]) -> Callable[[DecodeBatch], torch.Tensor]:
    """`step` behind a function with a code object of its own. Dynamo keeps compiled graphs, and the guards
    that choose among them, per code object: with its own, an engine (several share a process in tests and
    benchmarks) never runs, nor is guarded against, another engine's graphs."""
    def frame(batch: DecodeBatch) -> torch.Tensor:
        return step(batch)

    return types.FunctionType(frame.__code__.replace(), frame.__globals__, "decode_step", None, frame.__closure__)


def empty_decode(rows: int, keys: int, device: torch.device) -> DecodeBatch:
    """A decode step of padding rows only (position 0, slot 0): what warm-up runs."""
    z = torch.zeros(rows, dtype=torch.int64, device=device)
    return DecodeBatch(z, z.clone(), z.clone(), torch.zeros(rows, keys, dtype=torch.int64, device=device))


def pad(batch: DecodeBatch, rows: int) -> DecodeBatch:
    """`batch` with padding rows appended up to `rows`: token 0 at position 0 into slot 0, keys slot 0."""
    extra = rows - batch.input_ids.shape[0]
    if extra == 0:
        return batch
    z = torch.zeros(extra, dtype=torch.int64, device=batch.input_ids.device)
    return DecodeBatch(torch.cat([batch.input_ids, z]), torch.cat([batch.positions, z]),
                       torch.cat([batch.out_cache_loc, z]),
                       torch.cat([batch.key_slots, batch.key_slots.new_zeros(extra, batch.key_slots.shape[1])]))
