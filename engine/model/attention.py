"""Attention over the token-slot pool: extend (any chunk, with or without a cached prefix) and decode,
dense and block-sparse, plus the index-value branch. Torch-native (SDPA and gathers), CPU or CUDA.

Every function reads K/V through the segments' slot rows (ReqToTokenPool rows sliced once per step
in ForwardBatch), so a cached prefix and freshly written tokens are read the same way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from engine.model.config import ModelConfig
from engine.model.forward_batch import ForwardBatch, Segment, additive_mask
from engine.model.indexer import block_scores, select_blocks, select_one_query
from mem_cache import MiniMaxSparseKVPool


def gather_rows(buf: torch.Tensor, seg: Segment) -> torch.Tensor:
    """The segment's cached rows of one buffer [slots, heads, dim] -> [R, heads, N, dim]."""
    if seg.contiguous_start is not None:  # consecutive slots: a view, no copy
        rows = buf[seg.contiguous_start:seg.contiguous_start + seg.num_keys]
    else:
        rows = buf.index_select(0, seg.flat_slots)
    return rows.view(seg.rows, seg.num_keys, buf.shape[1], buf.shape[2]).transpose(1, 2)


def gather_head_major(buf: torch.Tensor, seg: Segment) -> torch.Tensor:
    """The segment's cached rows of one buffer [slots, heads, dim] as [R, heads, N, dim] (contiguous,
    or a strided view of the buffer when the row's slots are consecutive)."""
    heads, d = buf.shape[1], buf.shape[2]
    if seg.contiguous_start is not None:  # consecutive slots: a strided view, no gather
        return gather_rows(buf, seg)
    rows = buf.view(-1, d).index_select(0, seg.head_major_index(heads))
    return rows.view(seg.rows, heads, seg.num_keys, d)


# NOTE: a single decode row with at most this many keys runs through SDPA (one op, ~10-20 us faster on
# CPU); beyond it SDPA's one-query kernel does not split the keys across threads and is 2-3x slower.
SDPA_DECODE_MAX_KEYS = 2048


def single_row_decode(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, seg: Segment, scale: float,
                      bias: torch.Tensor | None) -> torch.Tensor:
    """One decode row as one SDPA call: each KV head's G query heads act as G queries over its keys
    (no GQA expansion); `bias` [1, n_kv or 1, 1, N] is additive and broadcasts over them."""
    k, v = gather_head_major(k_buf, seg), gather_head_major(v_buf, seg)  # [1, n_kv, N, D]
    o = F.scaled_dot_product_attention(q.view(1, k.shape[1], -1, k.shape[-1]), k, v, attn_mask=bias, scale=scale)
    return o.reshape(1, -1)  # query head h = kv * G + g, as GQA maps them


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, seg: Segment, scale: float,
                     keep: torch.Tensor | None) -> torch.Tensor:
    """One query per row (decode): q [R, n_q, D] over each row's cached keys, GQA-grouped.

    Both matmuls batch over (row, KV head) on head-major gathers, with no K/V copy per query head; `keep`
    [R, n_kv or 1, 1, N] masks keys out (padding, unselected blocks), None keeps all.
    """
    if seg.rows == 1 and keep is None and seg.num_keys <= SDPA_DECODE_MAX_KEYS:  # (masked rows: `_block_bias`)
        return single_row_decode(q, k_buf, v_buf, seg, scale, None)
    k, v = gather_head_major(k_buf, seg), gather_head_major(v_buf, seg)  # [R, n_kv, N, D]
    qh = q.view(seg.rows, k.shape[1], -1, k.shape[-1])  # [R, n_kv, G, D]
    s = torch.matmul(qh, k.transpose(-1, -2)).float() * scale  # [R, n_kv, G, N]
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)  # [R, n_kv, G, D]
    return o.reshape(seg.rows, -1)


def dense_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, seg: Segment,
                    scale: float) -> torch.Tensor:
    """Causal attention of q [R*T, n_q, D] over the segment's cached K/V [slots, n_kv, D] (GQA)."""
    r, t = seg.rows, seg.queries
    if t == 1:
        return decode_attention(q, k_buf, v_buf, seg, scale, seg.decode_keep)
    k, v = gather_rows(k_buf, seg), gather_rows(v_buf, seg)  # [R, n_kv, N, D]
    qh = q.view(r, t, q.shape[1], q.shape[2]).transpose(1, 2)  # [R, n_q, T, D]
    o = F.scaled_dot_product_attention(qh, k, v, attn_mask=seg.attn_bias(q.dtype), is_causal=seg.is_causal, scale=scale,
                                       enable_gqa=k.shape[1] != qh.shape[1])
    return o.transpose(1, 2).reshape(r * t, -1)


# NOTE: below this many keys per selected key (N <= factor * K * B), one dense SDPA with the block
# selection as a mask beats gathering K*B keys per query (measured on CPU: ~3-7x faster at N <= 2k,
# slower from N ~ 4k on). Both paths compute exactly model.md §3.4.
MASKED_SPARSE_MAX_FACTOR = 12
DECODE_MASKED_SPARSE_MAX_FACTOR = 2  # one query per row: gathering its K*B keys wins much earlier
# Queries handled at once by the indexer and the sparse paths of a long extend (keeps their
# [queries, keys] scores and gathered K/V cache-sized).
SPARSE_QUERY_CHUNK = 256


def masked_sparse_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, blocks: torch.Tensor,
                            seg: Segment, block_size: int, scale: float) -> torch.Tensor:
    """Sparse attention as dense SDPA under a mask built from the selected blocks [R, n_kv, T, K]."""
    r, t, n = seg.rows, seg.queries, seg.num_keys
    n_kv, nb = blocks.shape[1], -(-n // block_size)
    if r == 1 and t == 1 and n <= SDPA_DECODE_MAX_KEYS:  # one decode row: a block-level bias, no key mask
        return single_row_decode(q, k_buf, v_buf, seg, scale, _block_bias(blocks, n, block_size, q.dtype))
    keep = torch.zeros(r, n_kv, t, nb + 1, dtype=torch.bool, device=blocks.device)
    keep.scatter_(-1, torch.where(blocks < 0, nb, blocks), True)  # unused slots land in a spare column
    keep = keep[..., :nb].repeat_interleave(block_size, dim=-1)[..., :n]
    keep &= torch.arange(n, device=blocks.device)[None, None, None, :] <= seg.q_pos[:, None, :, None]
    if t == 1:
        return decode_attention(q, k_buf, v_buf, seg, scale, keep)  # [R, n_kv, 1, N] covers each group
    k, v = gather_rows(k_buf, seg), gather_rows(v_buf, seg)  # [R, n_kv, N, D]
    qh = q.view(r, t, q.shape[1], q.shape[2]).transpose(1, 2)  # [R, n_q, T, D]
    # one selection per KV head -> its query heads; additive (a bool mask is converted on every call)
    mask = additive_mask(keep, q.dtype).repeat_interleave(q.shape[1] // n_kv, dim=1)
    o = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, scale=scale, enable_gqa=n_kv != q.shape[1])
    return o.transpose(1, 2).reshape(r * t, -1)


def _block_bias(blocks: torch.Tensor, n: int, block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """One decode row's selected blocks [1, n_kv, 1, K] -> additive bias [1, n_kv, 1, N]: 0 on the keys
    of selected blocks, -inf elsewhere (all N keys precede the query, so no causal term)."""
    n_kv, nb = blocks.shape[1], -(-n // block_size)
    bias = torch.full((1, n_kv, 1, nb + 1), float("-inf"), dtype=dtype, device=blocks.device)
    bias.scatter_(-1, torch.where(blocks < 0, nb, blocks), 0.0)  # unused slots land in a spare column
    return bias[..., :nb, None].expand(1, n_kv, 1, nb, block_size).reshape(1, n_kv, 1, nb * block_size)[..., :n]


def gathered_sparse_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, blocks: torch.Tensor,
                              seg: Segment, block_size: int, scale: float) -> torch.Tensor:
    """Attention of q [R*T, n_q, D] restricted to the selected blocks [R, n_kv, T, K] (model.md §3.4).

    Gathers only the K*B selected keys per (query, KV head): the cost does not grow with context.
    """
    r, t = seg.rows, seg.queries
    n_kv = blocks.shape[1]
    d = q.shape[-1]
    offs = torch.arange(block_size, device=blocks.device)
    pos = (blocks.clamp(min=0)[..., None] * block_size + offs).flatten(-2)  # [R, n_kv, T, K*B]
    valid = (blocks >= 0).repeat_interleave(block_size, dim=-1) & (pos <= seg.q_pos[:, None, :, None])
    pos = pos.masked_fill(~valid, 0)
    slots = torch.gather(seg.slots, 1, pos.reshape(r, -1)).view(pos.shape)
    # NOTE: row (slot, head) of a buffer viewed as [slots * n_kv, D] is slot * n_kv + head.
    flat = (slots * n_kv + torch.arange(n_kv, device=blocks.device).view(1, n_kv, 1, 1)).reshape(-1)
    k = k_buf.view(-1, d).index_select(0, flat).view(*slots.shape, d)  # [R, n_kv, T, K*B, D]
    v = v_buf.view(-1, d).index_select(0, flat).view(*slots.shape, d)
    qh = q.view(r, t, n_kv, -1, d).transpose(1, 2)  # [R, n_kv, T, G, D]
    s = torch.matmul(qh, k.transpose(-1, -2)).float() * scale  # [R, n_kv, T, G, K*B]
    s = s.masked_fill(~valid[:, :, :, None, :], float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)  # [R, n_kv, T, G, D]
    return o.transpose(1, 2).reshape(r * t, -1)


def block_sparse_attention(q: torch.Tensor, k_rows: torch.Tensor, v_rows: torch.Tensor, blocks: torch.Tensor,
                           seg: Segment, block_size: int, scale: float) -> torch.Tensor:
    """Sparse attention for a one-row extend, gathering whole selected blocks from contiguous copies.

    k_rows/v_rows: the request's keys/values as [n_kv, nb, B, D] (positions padded to whole blocks),
    built once per layer; blocks [1, n_kv, T, K]. Same math as `gathered_sparse_attention`, with
    block-sized (not row-sized) copies.
    """
    t, (n_kv, nb, b, d) = seg.queries, k_rows.shape
    sel = blocks[0]  # [n_kv, T, K]
    valid_block = sel >= 0
    idx = (torch.where(valid_block, sel, 0) + torch.arange(n_kv, device=sel.device).view(n_kv, 1, 1) * nb).reshape(-1)
    k = k_rows.view(n_kv * nb, b * d).index_select(0, idx).view(n_kv, t, -1, d)  # [n_kv, T, K*B, D]
    v = v_rows.view(n_kv * nb, b * d).index_select(0, idx).view(n_kv, t, -1, d)
    pos = (torch.where(valid_block, sel, 0)[..., None] * b + torch.arange(b, device=sel.device)).flatten(-2)
    valid = valid_block.repeat_interleave(b, dim=-1) & (pos <= seg.q_pos[0][None, :, None])  # [n_kv, T, K*B]
    qh = q.view(t, n_kv, -1, d).transpose(0, 1)  # [n_kv, T, G, D]
    s = torch.matmul(qh, k.transpose(-1, -2)).float() * scale  # [n_kv, T, G, K*B]
    s = s.masked_fill(~valid[:, :, None, :], float("-inf"))
    o = torch.matmul(torch.softmax(s, dim=-1).to(v.dtype), v)  # [n_kv, T, G, D]
    return o.transpose(0, 1).reshape(t, -1)


def blocked_rows(buf: torch.Tensor, seg: Segment, block_size: int) -> torch.Tensor:
    """A one-row segment's cached rows as a contiguous [heads, nb, B, dim] copy (padded to whole blocks)."""
    rows = gather_rows(buf, seg)[0]  # [heads, N, dim]
    nb = -(-seg.num_keys // block_size)
    rows = F.pad(rows, (0, 0, 0, nb * block_size - seg.num_keys)).contiguous()
    return rows.view(rows.shape[0], nb, block_size, rows.shape[-1])


def select_for_segment(iq: torch.Tensor, ik_buf: torch.Tensor, seg: Segment, cfg: ModelConfig) -> torch.Tensor:
    """Run the indexer for one segment: iq [R*T, n_I, D_I] -> blocks [R, n_I, T, K]."""
    ik = gather_rows(ik_buf, seg)[:, 0]  # [R, N, D_I]
    iqh = iq.view(seg.rows, seg.queries, iq.shape[1], iq.shape[2])
    scores = block_scores(iqh, ik, seg.q_pos, cfg.block_size)
    if seg.rows == 1 and seg.queries == 1:
        return select_one_query(scores, seg.max_pos, cfg.block_size, cfg.topk_blocks, cfg.init_blocks,
                                cfg.local_blocks)
    return select_blocks(scores, seg.q_pos, cfg.block_size, cfg.topk_blocks, cfg.init_blocks, cfg.local_blocks)


def sparse_segment(layer_id: int, q: torch.Tensor, iq: torch.Tensor, seg: Segment, pool: MiniMaxSparseKVPool,
                   cfg: ModelConfig, scale: float) -> torch.Tensor:
    """Indexer + block-sparse attention for one segment, choosing the cheapest exact path."""
    k_buf, v_buf = pool.get_kv_buffer(layer_id)
    ik_buf = pool.get_index_k_buffer(layer_id)
    b, budget = cfg.block_size, cfg.topk_blocks * cfg.block_size
    if seg.rows > 1 or seg.queries == 1:  # decode: gather just the selected keys of each row
        blocks = select_for_segment(iq[seg.start:seg.end], ik_buf, seg, cfg)
        masked = seg.num_keys <= DECODE_MASKED_SPARSE_MAX_FACTOR * budget
        attend = masked_sparse_attention if masked else gathered_sparse_attention
        return attend(q[seg.start:seg.end], k_buf, v_buf, blocks, seg, b, scale)
    outs = []
    k_rows = v_rows = None
    for sub in seg.split(SPARSE_QUERY_CHUNK):  # bounded intermediates for long prompts
        blocks = select_for_segment(iq[sub.start:sub.end], ik_buf, sub, cfg)
        qs = q[sub.start:sub.end]
        if sub.num_keys <= MASKED_SPARSE_MAX_FACTOR * budget:
            outs.append(masked_sparse_attention(qs, k_buf, v_buf, blocks, sub, b, scale))
            continue
        if k_rows is None:  # the whole request's K/V in block layout, once per layer
            k_rows, v_rows = blocked_rows(k_buf, seg, b), blocked_rows(v_buf, seg, b)
        outs.append(block_sparse_attention(qs, k_rows, v_rows, blocks, sub, b, scale))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


def attention_layer(layer_id: int, q: torch.Tensor, iq: torch.Tensor | None, fb: ForwardBatch,
                    pool: MiniMaxSparseKVPool, cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Main attention output [T, n_q*D] and, for index-value layers, the index output [T, n_I*D_I].

    The caller has already written this step's K/V (and index K/V) into the pool.
    """
    k_buf, v_buf = pool.get_kv_buffer(layer_id)
    kind = cfg.layer_kinds[layer_id]
    scale = cfg.head_dim ** -0.5

    def main(seg: Segment) -> torch.Tensor:
        # NOTE: while every query sees at most K blocks, the selection keeps all of them and the
        # layer is exactly dense causal attention (model.md §3.3), so the indexer need not run.
        if kind == "dense" or seg.max_pos // cfg.block_size < cfg.topk_blocks:
            return dense_attention(q[seg.start:seg.end], k_buf, v_buf, seg, scale)
        return sparse_segment(layer_id, q, iq, seg, pool, cfg, scale)

    out = _over_segments(main, fb)
    if kind != "sparse_index_kv":
        return out, None
    ik_buf, iv_buf = pool.get_index_kv_buffer(layer_id)
    index_scale = cfg.index_head_dim ** -0.5
    # index-value branch: dense causal attention over the whole history (model.md §4)
    return out, _over_segments(lambda seg: dense_attention(iq[seg.start:seg.end], ik_buf, iv_buf, seg, index_scale), fb)


def _over_segments(fn: Callable[[Segment], torch.Tensor], fb: ForwardBatch) -> torch.Tensor:
    """Concatenate fn(segment) over the batch's segments (they tile its tokens in order)."""
    outs = [fn(seg) for seg in fb.segments]
    return outs[0] if len(outs) == 1 else torch.cat(outs)
