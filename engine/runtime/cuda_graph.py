"""Decode steps as CUDA graphs the engine captures itself: a graph per (batch bucket, key bucket) over `decode_step`,
all reading one set of static input buffers and sharing one memory pool; a graph's shapes are its buckets' (see `run`).
NOTE: capture costs an eager step a graph, vs ~50 s a graph to compile with inductor."""

import dataclasses
from collections.abc import Callable

import torch

from engine.model.forward_batch import DecodeBatch

Step = Callable[[DecodeBatch], torch.Tensor]


class CudaGraphs:
    def __init__(self, step: Step, buckets: tuple[int, ...], key_buckets: tuple[int, ...],
                 device: torch.device) -> None:
        self.step, self.buckets, self.key_buckets, self.replays = step, buckets, key_buckets, 0
        self.inputs = DecodeBatch.empty(buckets[-1], key_buckets[-1], device)
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # every graph's output rows (made at capture)

    def view(self, rows: int, keys: int) -> DecodeBatch:
        """The graph's static inputs for (rows, keys): leading slices of the largest buffers (key table contiguous)."""
        i = self.inputs
        return DecodeBatch(i.input_ids[:rows], i.positions[:rows], i.out_cache_loc[:rows],
                           i.key_slots.view(-1)[:rows * keys].view(rows, keys))

    @torch.no_grad()
    def capture(self, warm_each: bool = False) -> None:
        """Record every (batch, keys) graph, the largest first (the shared pool is sized by it), on a side stream;
        `warm_each`: each shape's step run once before its capture (a compiled step builds its kernels then). NOTE: one
        warm-up run before the first capture (lazy initializations happen there), and capture_begin / capture_end, not
        `torch.cuda.graph`, which synchronizes, collects garbage and empties the cache around each capture (84 graphs:
        17.9 s). Each graph copies its logits into one shared buffer and frees its own (~400 MB over 54 graphs)."""
        pool, side = torch.cuda.graph_pool_handle(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.logits = torch.empty_like(self.step(self.view(self.buckets[-1], self.key_buckets[-1])))
            for keys in reversed(self.key_buckets):
                for rows in reversed(self.buckets):
                    batch, graph = self.view(rows, keys), torch.cuda.CUDAGraph()
                    if warm_each:
                        self.step(batch)
                    graph.capture_begin(pool=pool)
                    try:
                        self.logits[:rows].copy_(self.step(batch))
                    finally:
                        graph.capture_end()
                    self.graphs[(rows, keys)] = graph
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()

    def run(self, batch: DecodeBatch, rows: int, keys: int) -> torch.Tensor:
        """Logits of `batch`'s rows through the (rows, keys) graph: its inputs copied into the static buffers, padding
        rows zeroed (slot 0, position 0). Key columns past the batch's width keep earlier steps' slots (valid, past
        every row's length: read by no kernel; copying and zeroing a 64 x 65,536 table: ~100 MB)."""
        n, width, view = batch.input_ids.shape[0], batch.key_slots.shape[1], self.view(rows, keys)
        for f in dataclasses.fields(DecodeBatch):
            dst, src = getattr(view, f.name), getattr(batch, f.name)
            (dst[:n, :width] if dst.dim() == 2 else dst[:n]).copy_(src)
            dst[n:].zero_()
        self.graphs[(rows, keys)].replay()
        self.replays += 1
        return self.logits[:n].clone()  # (the next replay writes the same buffer)
