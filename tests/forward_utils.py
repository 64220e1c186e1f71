"""A model stepped by hand through its own KV pool (tests): chunked extends and decode steps, logits of
every position. It builds what the engine builds, from public pieces, without a scheduler."""

from __future__ import annotations

import torch

from engine.model.forward_batch import DecodeBatch
from engine.model.model import MiniMaxM3Model
from engine.runtime.decode_graph import decode_step
from engine.runtime.engine_args import EngineArgs
from engine.runtime.model_runner import ModelRunner
from engine.runtime.scheduler import ScheduledBatch
from mem_cache import KVCacheManager, MiniMaxSparseKVPool


class PagedModel:
    def __init__(self, model: MiniMaxM3Model, size: int = 2048, max_requests: int = 8,
                 graph_buckets: list[int] | None = None) -> None:
        c, p = model.cfg, next(model.parameters())
        self.pool = MiniMaxSparseKVPool(size, p.dtype, list(c.layer_kinds), c.num_kv_heads, c.head_dim,
                                        c.index_head_dim, p.device)
        self.kv = KVCacheManager(size, max_requests, c.max_position_embeddings, p.device, disable_radix_cache=True)
        args = EngineArgs(disable_cuda_graph=not graph_buckets, cuda_graph_bs=graph_buckets)
        self.runner = ModelRunner(model, self.pool, args, min(size, c.max_position_embeddings))
        if graph_buckets:
            self.runner.graphs.warm_up()

    def run(self, prompts: list[list[int]], chunk: int, prefix: int | None = None) -> list[torch.Tensor]:
        """Feed each prompt `chunk` tokens per step (all prompts batched per step), or one extend of
        `prefix` tokens followed by one-token decode steps; logits of every position, per prompt."""
        kvs = [self.kv.admit([]) for _ in prompts]
        out: list[list[torch.Tensor]] = [[] for _ in prompts]
        while any(kv.num_computed < len(p) for kv, p in zip(kvs, prompts)):
            live = [i for i, (kv, p) in enumerate(zip(kvs, prompts)) if kv.num_computed < len(p)]
            steps = [prefix if prefix is not None and kvs[i].num_computed == 0 else (1 if prefix is not None else chunk)
                     for i in live]
            ids = [prompts[i][kvs[i].num_computed:kvs[i].num_computed + n] for i, n in zip(live, steps)]
            for i, logits in zip(live, self.step([kvs[i] for i in live], ids)):
                out[i].append(logits)
        for kv, p in zip(kvs, prompts):
            self.kv.release(kv, p)
        assert self.kv.check_integrity()
        return [torch.cat(o) for o in out]

    @torch.no_grad()
    def decode_step(self, batch: DecodeBatch) -> torch.Tensor:
        """The runner's decode step, eager."""
        return decode_step(self.runner.model, self.runner.pool, batch)

    def step(self, kvs: list, ids: list[list[int]]) -> list[torch.Tensor]:
        """One batched step: request i feeds ids[i]; its logits at each fed position."""
        prefix = [kv.num_computed for kv in kvs]
        loc = self.kv.allocate([(kv, len(x)) for kv, x in zip(kvs, ids)])
        batch = ScheduledBatch([], [kv.row for kv in kvs], prefix, ids, loc)
        logits = self.runner.forward(batch, self.kv.table, list(range(sum(len(x) for x in ids))))
        return list(logits.split([len(x) for x in ids]))

    def decode_batch(self, kvs: list, tokens: list[int]) -> DecodeBatch:
        """A decode step's fixed-shape inputs: request i feeds tokens[i] (its slot allocated now)."""
        prefix = [kv.num_computed for kv in kvs]
        loc = self.kv.allocate([(kv, 1) for kv in kvs])
        return self.runner.decode_batch(ScheduledBatch([], [kv.row for kv in kvs], prefix, [[t] for t in tokens], loc),
                                        self.kv.table)

    def logits(self, ids: list[int]) -> torch.Tensor:
        """Logits at every position of one prompt, in one extend."""
        return self.run([ids], chunk=len(ids))[0]


def assert_captured_equals_eager(paged: PagedModel, rows: int) -> None:
    """`rows` requests past the top-k budget, near a block edge, decode 6 steps (each crosses a block boundary)
    through the captured graph of their bucket and eager: logits within 1e-5, the same greedy tokens."""
    cfg = paged.runner.model.cfg
    g = torch.Generator().manual_seed(rows)
    lengths = [cfg.block_size * (cfg.topk_blocks + 1) - 2 + 3 * r for r in range(rows)]
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=g).tolist() for n in lengths]
    kvs = [paged.kv.admit([]) for _ in prompts]
    last = [int(x[-1].argmax()) for x in paged.step(kvs, prompts)]
    for _ in range(6):
        batch = paged.decode_batch(kvs, last)
        assert paged.runner.graphs.bucket(rows) in paged.runner.graphs.ready()
        captured = paged.runner.graphs.run(batch)
        eager = paged.decode_step(batch)  # writes the same K/V again: same values
        assert captured.shape == eager.shape == (rows, cfg.vocab_size)
        assert (captured - eager).abs().max().item() < 1e-5
        assert captured.argmax(-1).tolist() == eager.argmax(-1).tolist()
        last = eager.argmax(-1).tolist()
    assert paged.runner.graphs.info()["guard_misses"] == 0  # (a refused batch runs eager: then nothing was compared)
    for kv, p in zip(kvs, prompts):
        paged.kv.release(kv, p + [0] * (kv.num_computed - len(p)))
    assert paged.kv.check_integrity()
