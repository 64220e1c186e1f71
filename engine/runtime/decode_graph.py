"""Decode steps as captured graphs, one per batch-size bucket (SGLang's `--cuda-graph-bs`). A decode step is one
function of the model, the KV pool and fixed-shape tensors (`decode_step` over a `DecodeBatch`) with no host sync
inside. On CPU inductor compiles it ahead of time, twice: for batch 1, and with the batch size dynamic for every other
bucket (the key length dynamic in both); a later start loads the saved graphs (`precompiled.py`). On CUDA the engine
captures CUDA graphs itself at warm-up, one per batch bucket for any context (`cuda_graph.py`; see KEY_BUCKET): of the
eager step, or with --enable-torch-compile of the two compiled graphs (SGLang's way). A batch is padded up to the next
bucket (padding rows write and read only the pool's padding slot 0); one past the largest bucket runs eager."""

import dataclasses
import logging
import sys
import time

import torch
import torch.nn.functional as F

from engine.kernels import triton_decode
from engine.model.forward_batch import DecodeBatch, ForwardBatch
from engine.model.model import MiniMaxM3Model
from engine.runtime.cuda_graph import CudaGraphs, Step
from engine.runtime.engine_args import EngineArgs
from engine.runtime.precompiled import PrecompiledStep, store_path
from mem_cache import MiniMaxSparseKVPool

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)  # as SGLang's --cuda-graph-bs list starts
CPU_MAX_BS = 64  # NOTE: CPU buckets past 64 rows would add compile time for steps that are compute-bound anyway
# Decode key tables are padded to a multiple of KEY_BUCKET on CPU (one dynamic graph serves them all). On CUDA they are
# as wide as the longest context where Triton's decode kernels run (they read each row's key count); else up to the next
# power of two (at least the model's least key count), a graph per key bucket up to CUDA_MAX_KEYS (past it, eager).
KEY_BUCKET = 64
CUDA_MAX_KEYS = 8192
# A row's softmax sums keys in pieces of this many (graph_passes' `one_row_attention`): a step's key count is a
# multiple, at least two (else the graph specializes on padding or a size-1 dimension; past 4096 pieces, it splits).
SUM_PIECE = 64


def graph_buckets(args: EngineArgs, device: torch.device) -> tuple[int, ...]:
    """The batch sizes to capture: --cuda-graph-bs, else the default list up to --cuda-graph-max-bs."""
    if args.cuda_graph_bs:
        return tuple(sorted(set(args.cuda_graph_bs)))
    top = args.cuda_graph_max_bs or min(args.max_running_requests, CPU_MAX_BS if device.type == "cpu" else 256)
    return tuple(b for b in DEFAULT_BUCKETS if b < top) + (top,)


def decode_step(model: MiniMaxM3Model, pool: MiniMaxSparseKVPool, batch: DecodeBatch) -> torch.Tensor:
    """fp32 logits of every row of a decode step: the function the graphs capture (call it under no_grad)."""
    return model.compute_logits(model(batch, pool))


@torch.no_grad()
def build_kernels(model: MiniMaxM3Model, pool: MiniMaxSparseKVPool, keys: int) -> None:
    """The shapes serving launches, run once at start-up so that Triton builds its kernels then, not on first traffic
    (CUDA): a decode step `keys` wide (an extend's queries as decode attention's rows launch its kernels alike), and an
    extend past the top-k budget (its block kernel, the experts' grouped form), at positions the rotation table has."""
    decode_step(model, pool, DecodeBatch.empty(1, keys, pool.device))
    n = max(1, min((model.cfg.topk_blocks + 1) * model.cfg.block_size, model.cfg.max_position_embeddings))
    z = torch.zeros(n, dtype=torch.int64, device=pool.device)  # (every token to the padding slot 0: loc and table)
    model(ForwardBatch.build([0], [0], [[0] * n], z, z[None], pool.device), pool)


class DecodeGraphs:
    def __init__(self, model: MiniMaxM3Model, pool: MiniMaxSparseKVPool, buckets: tuple[int, ...],
                 device: torch.device, min_keys: int, max_keys: int, compile_cuda: bool = False) -> None:
        self.model, self.pool, self.buckets, self.device, self.min_keys = model, pool, buckets, device, min_keys
        self._compiled: set[int] = set()
        self.eager_steps, self._compiles_at_warm_up = 0, _compiles()  # (steps past the graphs; dynamo's graphs)
        self.key_buckets, self._one, self._many, self._wide = (), None, None, 0
        # NOTE: two graphs: batch 1 (static; on CPU its matrix-vector products as inductor's sums, see graph_passes,
        # imported here: its pattern matcher takes ~0.7 s), and every other bucket (batch dynamic). On CPU both with
        # the C++ wrapper, built apart from its kernels (at -O1): no Python launching their kernels (batch 1: 3.1 vs
        # 4.4 ms a step; 8 / 32 / 64 rows 1.05-1.07 / 0.99 / 0.98-0.99x), the cold compile no slower (27-28 vs 29-31 s).
        if buckets and (device.type == "cpu" or compile_cuda):
            one, many = {}, {}
            if device.type == "cpu":
                from engine.runtime.graph_passes import BatchOneForms
                many = {"cpp_wrapper": True, "cpp_wrapper_build_separate": True}
                one = many | {"post_grad_custom_post_pass": BatchOneForms()}
            self._one = PrecompiledStep(decode_step, one, store_path("one", model, pool), _marked)
            self._many = PrecompiledStep(decode_step, many, store_path("many", model, pool), _marked)
        if device.type != "cuda":
            return
        c, wide = model.cfg, self.key_width(max_keys)
        build_kernels(model, pool, wide)  # (one that fails leaves key buckets)
        if triton_decode.serves(device, c.head_dim, c.block_size, *[c.index_head_dim] * c.any_sparse):
            self.key_buckets, self._wide = (wide,), wide  # (any context: one graph a batch size)
        else:
            top = min(CUDA_MAX_KEYS, max_keys)  # (min_keys, then powers of two up to the first >= top)
            self.key_buckets = (min_keys, *(1 << j for j in range(min_keys.bit_length(), 40)
                                                if max(min_keys, 1 << j >> 1) < top))
        if buckets:
            self._cuda = CudaGraphs(captured_step(model, pool, self._one, self._many), buckets, self.key_buckets, device)

    def key_width(self, need: int) -> int:
        """Key-table width for a longest row of `need` keys (on CUDA, its graph's key bucket: the first as wide)."""
        return max(self.min_keys, -(-need // KEY_BUCKET) * KEY_BUCKET)

    def info(self) -> dict:
        """What was captured, and how serving has used it (for /server_info)."""
        cuda = self.device.type == "cuda" and bool(self.buckets)
        return {"batch_sizes": list(self.ready()), "key_buckets": list(self.key_buckets),
                "graphs": len(self._cuda.graphs) if cuda else len({self._graph(b) for b in self._compiled}),
                "replays": self._cuda.replays if cuda else None, "eager_steps": self.eager_steps,
                "compiled": self._one is not None,  # (and the steps its guards refused, eager: 0 when all is well)
                "guard_misses": sum(g.guard_misses for g in {self._one, self._many}) if self._one else 0,
                "compiles_since_warm_up": _compiles() - self._compiles_at_warm_up}

    def ready(self) -> tuple[int, ...]:
        return tuple(sorted(self._compiled))

    def bucket(self, rows: int) -> int | None:
        return next((b for b in self.buckets if b >= rows), None)

    def warm_up(self) -> None:
        """Load or compile every bucket's graph (CPU; CUDA with --enable-torch-compile), then on CUDA capture them."""
        # NOTE: one compile after the other: side by side (batch 1 in a child process) a cold start took 94.7 vs 86.5 s
        for i, b in enumerate(self.buckets if self._one else ()):
            t, example, graph = time.perf_counter(), DecodeBatch.empty(b, self.min_keys, self.device), self._graph(b)
            how = "same graph" if graph.prepared() else graph.prepare(self.model, self.pool, example)
            self._call(b, example)
            self._compiled.add(b)
            logger.info("decode graph %d/%d: batch %d ready in %.1f s (%s)", i + 1, len(self.buckets), b,
                        time.perf_counter() - t, how)
        if self.buckets and self.device.type == "cuda":
            t = time.perf_counter()
            self._cuda.capture(warm_each=self._one is not None or len(self.key_buckets) > 1)  # (kernels built first)
            self._compiled.update(self.buckets)
            logger.info("decode graphs: %d captured (batch %s x keys %s) in %.1f s", len(self._cuda.graphs),
                        list(self.buckets), list(self.key_buckets), time.perf_counter() - t)
        self._compiles_at_warm_up = _compiles()

    def run(self, batch: DecodeBatch) -> torch.Tensor:
        (rows, width), cuda = batch.key_slots.shape, self.device.type == "cuda"
        b, keys = self.bucket(rows), next((k for k in self.key_buckets if k >= width), width)
        if b is None or b not in self._compiled or (cuda and (b, keys) not in self._cuda.graphs):
            self.eager_steps += bool(self._compiled)
            if self.eager_steps == 1:
                logger.info("a decode step of %d rows x %d keys is past the captured graphs: it runs eager (this "
                            "is said once)", rows, keys)
            if self._wide and triton_decode.serves(self.device):  # (the graphs' width: NB, a constexpr, built once)
                batch = dataclasses.replace(batch, key_slots=F.pad(batch.key_slots, (0, self._wide - width)))
            with torch.no_grad():
                return decode_step(self.model, self.pool, batch)
        return self._cuda.run(batch, b, keys) if cuda else self._call(b, pad(batch, b))[:rows]

    def _graph(self, b: int) -> PrecompiledStep:
        return self._one if b == 1 else self._many  # NOTE: a dimension of size 1 cannot be dynamic

    @torch.no_grad()  # NOTE: always: the graphs are compiled under no_grad
    def _call(self, b: int, batch: DecodeBatch) -> torch.Tensor:
        return self._graph(b)(self.model, self.pool, batch)


def captured_step(model: MiniMaxM3Model, pool: MiniMaxSparseKVPool, one: PrecompiledStep | None,
                  many: PrecompiledStep | None) -> Step:
    """The step CUDA graphs capture: the compiled graphs' (--enable-torch-compile), else the eager one. NOTE: a
    closure over these, not over DecodeGraphs: a cycle would keep a deleted engine's GPU memory until a collection."""
    if one is None:
        return lambda b: decode_step(model, pool, b)
    return lambda b: (one if len(b.input_ids) == 1 else many)(model, pool, b)


def _compiles() -> int:
    """Graphs dynamo compiled in this process, any (none if never imported: CUDA and eager starts skip its ~0.9 s)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"] if "torch._dynamo" in sys.modules else 0


def _marked(batch: DecodeBatch) -> DecodeBatch:
    torch._dynamo.mark_dynamic(batch.key_slots, 1)
    if batch.input_ids.shape[0] > 1:
        for t in (batch.input_ids, batch.positions, batch.out_cache_loc, batch.key_slots):
            torch._dynamo.mark_dynamic(t, 0)
    return batch


def pad(batch: DecodeBatch, rows: int) -> DecodeBatch:
    if (extra := rows - batch.input_ids.shape[0]) == 0:
        return batch
    z = DecodeBatch.empty(extra, batch.key_slots.shape[1], batch.input_ids.device)
    return DecodeBatch(*(torch.cat([getattr(batch, f.name), getattr(z, f.name)]) for f in dataclasses.fields(z)))
