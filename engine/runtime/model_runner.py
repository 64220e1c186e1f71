"""ModelRunner: the model and its KV pool. Turns a scheduled batch into a ForwardBatch, runs the model
and returns logits for the rows the caller asks for."""

from __future__ import annotations

import torch

from engine.model.forward_batch import ForwardBatch
from engine.model.model import MiniMaxM3Model
from engine.runtime.engine_args import EngineArgs
from engine.runtime.scheduler import ScheduledBatch
from mem_cache import MiniMaxSparseKVPool


class ModelRunner:
    def __init__(self, model: MiniMaxM3Model, pool: MiniMaxSparseKVPool, args: EngineArgs) -> None:
        self.model, self.pool = model, pool
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype

    def captured_batch_sizes(self) -> tuple[int, ...]:
        return ()

    def warm_up(self) -> None:
        pass

    def forward(self, batch: ScheduledBatch, table: torch.Tensor, logit_rows: list[int]) -> torch.Tensor:
        """fp32 logits of the batch's flattened tokens at `logit_rows`; `table` maps (row, position) -> slot."""
        fb = ForwardBatch.build(batch.rows, batch.prefix_lens, batch.new_ids, batch.out_cache_loc, table, self.device)
        hidden = self.model(fb, self.pool)
        return self.model.compute_logits(hidden[torch.tensor(logit_rows, dtype=torch.int64, device=self.device)])
