"""ModelRunner: the model and its KV pool. A scheduled batch becomes an extend (`ForwardBatch`, eager) or, when all feed
one token, a fixed-shape decode step (`DecodeBatch`), run by a captured graph if one covers its batch size."""

import torch
import torch.nn.functional as F

from engine.model.forward_batch import DecodeBatch, ForwardBatch
from engine.model.model import MiniMaxM3Model
from engine.runtime.decode_graph import KEY_BUCKET, SUM_PIECE, DecodeGraphs, graph_buckets
from engine.runtime.engine_args import EngineArgs
from engine.runtime.scheduler import ScheduledBatch
from mem_cache import MiniMaxSparseKVPool

assert KEY_BUCKET % SUM_PIECE == 0  # (decode key tables are padded to a multiple of both)


class ModelRunner:
    def __init__(self, model: MiniMaxM3Model, pool: MiniMaxSparseKVPool, args: EngineArgs, max_keys: int) -> None:
        self.model, self.pool, c = model, pool, model.cfg
        self.device = next(model.parameters()).device
        # NOTE: decode keys span at least K + 1 blocks, so a graph always sees more blocks than it selects, and
        # at least two SUM_PIECEs, in whole KEY_BUCKETs: no shape-specialized branch, no recompile as a context grows.
        least = max((c.topk_blocks + 1) * c.block_size if c.any_sparse else 0, 2 * SUM_PIECE)
        self.min_keys = -(-least // KEY_BUCKET) * KEY_BUCKET
        buckets = () if args.disable_cuda_graph else graph_buckets(args, self.device)
        self.graphs = DecodeGraphs(model, pool, buckets, self.device, self.min_keys, max_keys, args.enable_torch_compile)
        self._last: tuple | None = None  # the last decode step's (rows, positions)
        self._tokens: torch.Tensor | None = None  # the tokens sampled last

    @torch.no_grad()
    def forward(self, batch: ScheduledBatch, table: torch.Tensor, logit_rows: list[int]) -> torch.Tensor:
        """fp32 logits of the batch's flattened tokens at `logit_rows`; `table` maps (row, position) -> slot."""
        if all(len(x) == 1 for x in batch.new_ids):
            return take_rows(self.graphs.run(self.decode_batch(batch, table)), logit_rows)
        fb = ForwardBatch.build(batch.rows, batch.prefix_lens, batch.new_ids, batch.out_cache_loc, table, self.device)
        return self.model.compute_logits(take_rows(self.model(fb, self.pool), logit_rows))

    def decode_batch(self, batch: ScheduledBatch, table: torch.Tensor) -> DecodeBatch:
        """The step's fixed-shape inputs; keys padded to the graphs' key bucket (padding is masked)."""
        n, dev = self.graphs.key_width(max(batch.prefix_lens) + 1), self.device
        if batch.steady:  # NOTE: the last step's tensors, advanced on the device: none built from a Python list (each
            (rows, pos), ids = self._last, self._tokens  # a host-to-device copy; on CUDA copies and syncs cost most)
            pos = pos + 1
        else:
            rows, ids, pos = (torch.tensor(x, dtype=torch.int64, device=dev) for x in
                              (batch.rows, [x[0] for x in batch.new_ids], batch.prefix_lens))
        self._last = (rows, pos)
        keys = table[rows, :n].to(torch.int64)
        keys = F.pad(keys, (0, n - keys.shape[1])) if n > keys.shape[1] else keys  # (past the table: padding, masked)
        return DecodeBatch(ids, pos, batch.out_cache_loc.to(dev, torch.int64), keys)

    def sampled(self, tokens: torch.Tensor, out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Keep the tokens just sampled (on the device: a steady next step's inputs); return `out` (default: them) on
        its way to the host and the event to wait for before reading it (CUDA: a copy into pinned memory; else itself)."""
        self._tokens, out = tokens, tokens if out is None else out
        if self.device.type != "cuda":
            return out, None
        host, ready = torch.empty(out.shape, dtype=out.dtype, pin_memory=True), torch.cuda.Event()
        host.copy_(out, non_blocking=True)
        ready.record()
        return host, ready


def take_rows(x: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """x[rows], x itself when rows are all of x in order (NOTE: copying 64 x 4,096 logits: ~60-100 us, 3 a step)."""
    if len(rows) == x.shape[0] and rows == list(range(len(rows))):
        return x
    return x[torch.tensor(rows, dtype=torch.int64, device=x.device)]
