"""ForwardBatch: what one model step computes, and the attention metadata built once for all layers."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass(frozen=True)
class Segment:
    """R rows of T queries each, over token range [start, start + R*T) of the batch (row-major).

    `slots[r, j]` is the token slot holding position j of row r's request (j < N); `q_pos[r, t]` is
    the absolute position of query t of row r. A query attends only to positions <= its own, so
    padding columns (j >= that row's length) are never read.
    """

    start: int
    rows: int
    queries: int
    slots: torch.Tensor  # [R, N] int64
    q_pos: torch.Tensor  # [R, T] int64
    max_pos: int  # max over q_pos, as a Python int (no device sync later)

    @property
    def end(self) -> int:
        return self.start + self.rows * self.queries

    @property
    def num_keys(self) -> int:
        """Key positions any query of the segment can see: 0..max_pos."""
        return self.max_pos + 1

    @cached_property
    def contiguous_start(self) -> int | None:
        """The first slot when the segment is one row whose keys sit in consecutive slots (then
        buffers are read as views, with no gather); else None."""
        if self.rows != 1:
            return None
        row = self.slots[0, : self.num_keys]
        if self.num_keys > 1 and not bool(((row[1:] - row[:-1]) == 1).all()):
            return None
        return int(row[0])

    @cached_property
    def flat_slots(self) -> torch.Tensor:
        """slots[:, :num_keys] flattened, for one index_select per buffer (built once per step)."""
        return self.slots[:, : self.num_keys].reshape(-1)

    def split(self, max_queries: int) -> list[Segment]:
        """Sub-segments of at most `max_queries` queries (one-row extends; their positions are
        consecutive, so each piece sees keys up to its own last query)."""
        if self.rows != 1 or self.queries <= max_queries:
            return [self]
        last = self.max_pos - self.queries + 1  # position of query 0
        return [Segment(self.start + a, 1, min(max_queries, self.queries - a), self.slots,
                        self.q_pos[:, a:a + max_queries], last + min(self.queries, a + max_queries) - 1)
                for a in range(0, self.queries, max_queries)]

    def head_major_index(self, heads: int) -> torch.Tensor:
        """Row index into a buffer viewed as [slots * heads, dim] that gathers the segment's keys as
        [R, heads, N, dim] (contiguous, head-major): slot * heads + head. Built once per step."""
        cache = self.__dict__.setdefault("_head_major", {})
        if heads not in cache:
            h = torch.arange(heads, device=self.slots.device).view(1, heads, 1)
            cache[heads] = (self.slots[:, None, : self.num_keys] * heads + h).reshape(-1)
        return cache[heads]

    @cached_property
    def decode_keep(self) -> torch.Tensor | None:
        """[R, 1, 1, N] bool for one-query rows of different lengths (padding off); None for one row."""
        if self.rows == 1:
            return None
        j = torch.arange(self.num_keys, device=self.q_pos.device)
        return (j[None, :] <= self.q_pos).view(self.rows, 1, 1, self.num_keys)

    @cached_property
    def is_causal(self) -> bool:
        """True when the plain top-left causal mask is exact (one row whose queries start at 0)."""
        return self.rows == 1 and self.queries == self.num_keys

    def attn_bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """`attn_mask` as an additive mask in `dtype` (0 visible, -inf hidden): SDPA on CPU runs ~2x
        faster with it than with a bool mask, which it converts on every call. Built once per step."""
        mask = self.attn_mask
        if mask is None:
            return None
        cache = self.__dict__.setdefault("_attn_bias", {})
        if dtype not in cache:
            cache[dtype] = additive_mask(mask, dtype)
        return cache[dtype]

    @cached_property
    def attn_mask(self) -> torch.Tensor | None:
        """[R, 1, T, N] bool (key j visible to query t iff j <= q_pos[t]); None when not needed."""
        if self.is_causal or (self.queries == 1 and self.rows == 1):
            return None
        j = torch.arange(self.num_keys, device=self.q_pos.device)
        return (j[None, None, :] <= self.q_pos[:, :, None]).unsqueeze(1)


def additive_mask(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True = visible) as an additive one: 0 where visible, -inf elsewhere."""
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill_(~keep, float("-inf"))


def decode_buckets(seq_lens: list[int], slack: float = 1.5, min_rows: int = 16) -> list[tuple[int, int, int]]:
    """Split decode rows into consecutive groups of similar length: (first row, end row, max length).

    Each group pads its keys to its own longest row, so rows sorted by length (the scheduler sorts
    them) waste little on padding; unsorted rows are still correct, just padded more.
    """
    out, a = [], 0
    while a < len(seq_lens):
        b, top = a, seq_lens[a]
        while b < len(seq_lens) and (b - a < min_rows or seq_lens[b] <= slack * seq_lens[a]):
            top = max(top, seq_lens[b])
            b += 1
        out.append((a, b, top))
        a = b
    return out


@dataclass
class ForwardBatch:
    """One step's inputs. Decode is the case where every request extends by exactly one token.

    `out_cache_loc[i]` is the slot that new token i's K/V (and index K/V) are written to;
    `req_to_token` rows map each request's positions to slots (the caller has already written the
    new tokens' slots into them).
    """

    input_ids: torch.Tensor  # [T_total] int64
    positions: torch.Tensor  # [T_total] int64
    out_cache_loc: torch.Tensor  # [T_total] int64
    req_pool_indices: list[int]
    prefix_lens: list[int]
    extend_lens: list[int]
    req_to_token: torch.Tensor
    segments: list[Segment] = field(default_factory=list)

    def __post_init__(self) -> None:
        n = len(self.req_pool_indices)
        assert len(self.prefix_lens) == n and len(self.extend_lens) == n, "one prefix/extend length per request"
        assert all(e >= 1 for e in self.extend_lens), "every request must bring at least one new token"
        assert self.input_ids.shape[0] == sum(self.extend_lens) == self.out_cache_loc.shape[0]
        if not self.segments:
            self.segments = self._build_segments()

    @classmethod
    def build(cls, rows: list[int], prefix_lens: list[int], new_ids: list[list[int]], out_cache_loc: torch.Tensor,
              req_to_token: torch.Tensor, device: torch.device) -> ForwardBatch:
        """Request i (table row rows[i]) feeds new_ids[i] at positions prefix_lens[i]...; the new tokens'
        slots (`out_cache_loc`) are already written into the table."""
        ids = [t for x in new_ids for t in x]
        positions = [p for p0, x in zip(prefix_lens, new_ids) for p in range(p0, p0 + len(x))]
        return cls(torch.tensor(ids, dtype=torch.int64, device=device),
                   torch.tensor(positions, dtype=torch.int64, device=device),
                   out_cache_loc.to(device, torch.int64), list(rows), list(prefix_lens), [len(x) for x in new_ids],
                   req_to_token)

    @property
    def is_decode(self) -> bool:
        return all(e == 1 for e in self.extend_lens)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens)]

    def _build_segments(self) -> list[Segment]:
        dev = self.input_ids.device
        rows = torch.tensor(self.req_pool_indices, dtype=torch.int64, device=dev)
        if self.is_decode:
            return [Segment(a, b - a, 1, self.req_to_token[rows[a:b], : n_max].to(torch.int64),
                            self.positions[a:b].view(-1, 1), n_max - 1)
                    for a, b, n_max in decode_buckets(self.seq_lens)]
        # NOTE: one segment per extending request: dense attention runs over it in one (causal) call;
        # the indexer and the sparse paths split it into bounded query chunks themselves.
        segments, start = [], 0
        for r, (p, e) in enumerate(zip(self.prefix_lens, self.extend_lens)):
            slots = self.req_to_token[rows[r], : p + e].to(torch.int64).view(1, -1)
            segments.append(Segment(start, 1, e, slots, self.positions[start:start + e].view(1, -1), p + e - 1))
            start += e
        return segments
