"""A decode graph compiled ahead of time and kept on disk, so a warm start loads it instead of tracing the model again
(CPU). `torch.compile(...).aot_compile` traces a step function of (model, pool, batch) once into a saveable function:
the model's parameters and the pool's buffers stay arguments, so one file serves every engine of the same shapes. It
lands in `<TORCHINDUCTOR_CACHE_DIR>/minimax_graphs/`, named by a hash of all it depends on (`graph_key`). NOTE: dynamo's
trace was most of a warm start (12-25 s for the two graphs vs ~1.5 s to load each). The guards dynamo built (shapes,
dtypes, grad mode, config values) decide whether a batch may run the graph; one that fails them runs eager, with a
warning, counted (`guard_misses`). Model and pool never change under a graph (its name hashes their shapes): the verdict
is kept per batch signature (`_signature`; NOTE: checked each call, 1.90 vs 1.79 ms a batch-1 step)."""

import dataclasses
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from engine.kernels import build, moe_experts
from engine.model import layers
from engine.model.forward_batch import DecodeBatch
from engine.model.model import MiniMaxM3Model
from mem_cache import MiniMaxSparseKVPool

logger = logging.getLogger(__name__)

Step = Callable[[MiniMaxM3Model, MiniMaxSparseKVPool, DecodeBatch], torch.Tensor]
_ROOT = Path(__file__).resolve().parents[2]
_SOURCES = ("engine/model", "engine/kernels", "mem_cache", "engine/runtime/decode_graph.py",  # what a trace reads
            "engine/runtime/graph_passes.py", "engine/runtime/precompiled.py")


def graph_key(kind: str, model: MiniMaxM3Model, pool: MiniMaxSparseKVPool) -> str:
    """A hash of everything a compiled decode graph of `kind` depends on but its arguments' values."""
    p = next(model.parameters())
    facts = [torch.__version__, torch.backends.cpu.get_cpu_capability(), str(torch.get_num_threads()), kind,
             repr(model.cfg), str(p.dtype), str(p.device), torch.cuda.get_device_name(p.device) if p.is_cuda else "",
             repr([(tuple(t.shape), t.dtype) for sub in pool.sub_pools() for t in sub.tensors()])]
    files = sorted(f for s in _SOURCES for f in ([_ROOT / s] if s.endswith(".py") else (_ROOT / s).glob("*.[pch]*"))
                   if f.suffix in (".py", ".c", ".h"))
    return hashlib.sha256("\0".join(facts).encode() + b"".join(f.read_bytes() for f in files)).hexdigest()[:20]


class PrecompiledStep:
    """`step` compiled with inductor `options` for the batches an example stands for (`mark` marks which of
    its dimensions are dynamic), loaded from `path` when a start before this one saved it there."""

    def __init__(self, step: Step, options: dict[str, Any], path: Path,
                 mark: Callable[[DecodeBatch], DecodeBatch]) -> None:
        self.step, self.options, self.path, self.mark, self.guard_misses = step, options, path, mark, 0
        self._fn: Any = None
        self._verdicts: dict[tuple, bool] = {}  # _signature(batch) -> the guards' verdict

    def prepared(self) -> bool:
        return self._fn is not None

    @torch.no_grad()  # (grad mode is one of the guards)
    def prepare(self, model: MiniMaxM3Model, pool: MiniMaxSparseKVPool, example: DecodeBatch) -> str:
        """Load the saved graph, or compile it and save it; "loaded" or "compiled". A file that cannot be loaded
        (another torch, a broken file) or whose guards refuse `example` is compiled again and replaced."""
        if self.path.exists():
            try:
                with self.path.open("rb") as f:
                    fn = torch.compiler.load_compiled_function(f)
                if fn.guard_check(model, pool, example):
                    self._fn = fn
                    self._fn.disable_guard_check()  # (checked in __call__, with a fallback instead of a raise)
                    return "loaded"
                logger.warning("%s: its guards refuse this engine: compiling again", self.path.name)
            except Exception as e:  # (any failure to load means: compile)
                logger.warning("%s could not be loaded (%s): compiling again", self.path.name, e)
        # NOTE: marked on a copy: a tensor marked dynamic fails the guards at run time (batches come unmarked)
        marked = self.mark(DecodeBatch(*dataclasses.astuple(example)))  # (astuple copies the tensors)
        for fn in (moe_experts.built, layers.hopper_or_later.__wrapped__):  # (which MoE form runs: answers, not traced)
            torch.compiler.assume_constant_result(fn)
        fn = torch.compile(self.step, fullgraph=True, options={**self.options}).aot_compile(((model, pool, marked), {}))
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fn.save_compiled_function(str(self.path))  # (written apart, then renamed: processes may race)
        except Exception as e:  # (serving goes on; a later start compiles again)
            logger.warning("%s could not be saved (%s): a later start compiles it again", self.path.name, e)
        fn.disable_guard_check()
        self._fn = fn
        return "compiled"

    def __call__(self, model: MiniMaxM3Model, pool: MiniMaxSparseKVPool, batch: DecodeBatch) -> torch.Tensor:
        key = _signature(batch)
        if (ok := self._verdicts.get(key)) is None:
            ok = self._verdicts[key] = bool(self._fn.guard_check(model, pool, batch))
        if ok:
            return self._fn(model, pool, batch)
        self.guard_misses += 1
        if self.guard_misses == 1:
            logger.warning("a decode batch of %s fails the guards of %s: it runs eager", tuple(batch.key_slots.shape),
                           self.path.name)
        return self.step(model, pool, batch)


def _signature(batch: DecodeBatch) -> tuple:
    """What of a batch the guards read: each tensor's shape, strides, dtype, device, shared storage; the grad mode."""
    ts = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    return (torch.is_grad_enabled(), len({t.untyped_storage().data_ptr() for t in ts}),
            *((t.shape, t.stride(), t.dtype, t.device) for t in ts))


def store_path(kind: str, model: MiniMaxM3Model, pool: MiniMaxSparseKVPool) -> Path:
    return build.cache_dir("minimax_graphs") / f"decode-{kind}-{graph_key(kind, model, pool)}.bin"
