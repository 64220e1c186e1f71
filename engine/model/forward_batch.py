"""What one model step computes: an extend (`ForwardBatch`: each request a chunk of tokens, one `Segment`
each) or a decode step (`DecodeBatch`: one token per request, fixed-shape tensors for eager or captured)."""

import functools
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class Segment:
    """One extending request: batch tokens [start, start + queries) at positions first_pos..; `slots[j]`: position j."""

    start: int
    queries: int
    first_pos: int
    slots: torch.Tensor  # [N] int64, N = first_pos + queries
    _bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @property
    def end(self) -> int:
        return self.start + self.queries

    @property
    def num_keys(self) -> int:
        return self.first_pos + self.queries

    def causal_bias(self, dtype: torch.dtype) -> torch.Tensor:
        """[queries, N] additive mask: 0 where query t sees key j (j <= first_pos + t), else -inf. NOTE: made once per
        segment and dtype for all dense and index-value layers (a chunked 4k prefill's 2048 x 4096 mask: ~20-40 ms)."""
        if dtype not in self._bias:
            full = torch.full((self.queries, self.num_keys), float("-inf"), dtype=dtype, device=self.slots.device)
            self._bias[dtype] = full.triu_(self.first_pos + 1)
        return self._bias[dtype]

    def q_pos(self, a: int, b: int) -> torch.Tensor:
        """Positions of queries a..b-1 of the segment, [1, b - a]."""
        return torch.arange(self.first_pos + a, self.first_pos + b, device=self.slots.device)[None]


@dataclass
class ForwardBatch:
    """An extend: `out_cache_loc[i]` is the slot new token i's K/V (and index K/V) go to."""

    input_ids: torch.Tensor  # [T_total] int64
    positions: torch.Tensor  # [T_total] int64
    out_cache_loc: torch.Tensor  # [T_total] int64
    segments: list[Segment]
    token_request: torch.Tensor  # [T_total] int64: the request (segment) of each token
    key_table: torch.Tensor | None  # [requests, longest]: request i's slots by position; None: over half padding
    _slots: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    def slots_of(self, idx: tuple[int, ...]) -> torch.Tensor:
        """The key slots of segments `idx`, end to end (made once a step: every layer gathers its keys by them)."""
        if idx not in self._slots:
            self._slots[idx] = torch.cat([self.segments[i].slots for i in idx])
        return self._slots[idx]

    @functools.cached_property
    def query_rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(each token's request's row of the key table, its key count (position + 1)): the extend as rows of decode
        attention, one a query (made once a step)."""
        return self.key_table[self.token_request], self.positions + 1

    @classmethod
    def build(cls, rows: list[int], prefix_lens: list[int], new_ids: list[list[int]], out_cache_loc: torch.Tensor,
              req_to_token: torch.Tensor, device: torch.device) -> "ForwardBatch":
        """Request i (row rows[i]) feeds new_ids[i] at positions prefix_lens[i]...; `out_cache_loc` is in the table."""
        ids, positions, of, ends = [], [], [], [p + len(x) for p, x in zip(prefix_lens, new_ids)]
        for i, (p, x) in enumerate(zip(prefix_lens, new_ids)):
            ids += x
            positions += range(p, p + len(x))
            of += [i] * len(x)
        t = len(ids)  # (one copy to the device, from pinned memory: no sync)
        at = torch.tensor(ids + positions + of + rows, pin_memory=device.type == "cuda").to(device, non_blocking=True)
        # (the key table: one gather for all requests, unless its padding would fill over half of it)
        table = req_to_token[at[3 * t:], :max(ends)].long() if len(rows) * max(ends) <= 2 * sum(ends) else None
        segments, start = [], 0
        for i, (r, p, e) in enumerate(zip(rows, prefix_lens, ends)):
            slots = req_to_token[r, :e].to(device, torch.int64) if table is None else table[i, :e]
            segments.append(Segment(start, e - p, p, slots))
            start += e - p
        return cls(at[:t], at[t:2 * t], out_cache_loc.to(device, torch.int64), segments, at[2 * t:3 * t], table)


@dataclass
class DecodeBatch:
    """A decode step as fixed-shape tensors: row r feeds `input_ids[r]` at `positions[r]` into slot `out_cache_loc[r]`
    and attends to keys `key_slots[r, :positions[r] + 1]`. NOTE: padding rows (a batch padded up to its graph bucket)
    write to slot 0, the pool's padding slot, and read only from it; keys past a row's length (padding) are masked"""

    input_ids: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64
    out_cache_loc: torch.Tensor  # [B] int64
    key_slots: torch.Tensor  # [B, N] int64

    @classmethod
    def empty(cls, rows: int, keys: int, device: torch.device) -> "DecodeBatch":
        """Padding rows only (position 0, slot 0): what warm-up runs, and CUDA graphs' static inputs."""
        z = torch.zeros(rows, dtype=torch.int64, device=device)
        return cls(z, z.clone(), z.clone(), torch.zeros(rows, keys, dtype=torch.int64, device=device))
