"""ModelRunner: owns the model and its pools; turns a list of (request row, prefix, new tokens) into a
ForwardBatch, runs the model, and returns logits for the positions the caller asks for."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.model import MiniMaxM3Model
from mem_cache import MiniMaxSparseKVPool, ReqToTokenPool, TokenSlotAllocator


@dataclass(frozen=True)
class ExtendItem:
    """One request's part of a step: its ReqToTokenPool row, tokens already cached, new token ids."""

    row: int
    prefix_len: int
    new_ids: list[int]

    def __post_init__(self) -> None:
        assert self.new_ids, "an extend item needs at least one new token"
        assert self.prefix_len >= 0


class ModelRunner:
    def __init__(self, model: MiniMaxM3Model, max_total_tokens: int, max_running_requests: int,
                 context_len: int, page_size: int = 1) -> None:
        self.model = model
        self.cfg: ModelConfig = model.cfg
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.context_len = context_len
        self.pool = MiniMaxSparseKVPool(
            size=max_total_tokens, page_size=page_size, dtype=self.dtype, layer_kinds=list(self.cfg.layer_kinds),
            head_num=self.cfg.num_kv_heads, head_dim=self.cfg.head_dim, index_head_dim=self.cfg.index_head_dim,
            device=self.device)
        self.allocator = TokenSlotAllocator(max_total_tokens, page_size=page_size, device=self.device)
        self.req_to_token_pool = ReqToTokenPool(max_running_requests, context_len, device=self.device)

    def build_batch(self, items: list[ExtendItem], out_cache_loc: torch.Tensor) -> ForwardBatch:
        """The caller has allocated `out_cache_loc` and written it into each item's ReqToTokenPool row."""
        ids = [t for it in items for t in it.new_ids]
        positions = [p for it in items for p in range(it.prefix_len, it.prefix_len + len(it.new_ids))]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self.device),
            positions=torch.tensor(positions, dtype=torch.int64, device=self.device),
            out_cache_loc=out_cache_loc.to(self.device, torch.int64),
            req_pool_indices=[it.row for it in items],
            prefix_lens=[it.prefix_len for it in items],
            extend_lens=[len(it.new_ids) for it in items],
            req_to_token=self.req_to_token_pool.req_to_token)

    def forward(self, fb: ForwardBatch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits of the batch's tokens at `rows` (indices into the flattened batch), or of all."""
        hidden = self.model(fb, self.pool)
        return self.model.compute_logits(hidden if rows is None else hidden[rows])
