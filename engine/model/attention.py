"""Attention over the token-slot pool (model.md §2-§4): dense, block-sparse and the index-value branch, for an extend (a
`Segment` per request) and a decode step (`DecodeBatch`); K/V read by slot, after the caller wrote this step's."""

import torch
import torch.nn.functional as F

from engine.kernels import triton_decode
from engine.kernels.triton_decode import block_attention, decode_attention
from engine.kernels.triton_indexer import decode_block_scores, decode_sparse_attention
from engine.model.config import ModelConfig
from engine.model.forward_batch import DecodeBatch, ForwardBatch, Segment
from engine.model.indexer import block_masks, block_scores, select_blocks
from mem_cache import MiniMaxSparseKVPool

QUERY_CHUNK = 256  # queries per chunk of a long sparse extend: bounds the [heads, queries, keys] scores and masks
# Keys an extend's dense attention gathers at once (requests in runs up to it; a longer one alone): requests that share
# a long cached prefix each gather their own copy of it (64 on a 65k-token prefix: ~2 GB at once for configs/tiny).
GATHER_KEYS = 16384
# CUDA: an extend of requests within the top-k budget, queries x longest key count at most this, runs as decode
# attention's rows, one a query: a launch a layer, not an SDPA a request (past short prompts, SDPA's tiles read less).
ROW_KEYS = 1 << 20


def attention(layer_id: int, q: torch.Tensor, iq: torch.Tensor | None, batch: ForwardBatch | DecodeBatch,
              pool: MiniMaxSparseKVPool, cfg: ModelConfig, masks: tuple | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Main attention output [T, n_q*D] and, for index-value layers, the index output [T, n_I*D_I]."""
    if isinstance(batch, DecodeBatch):
        return _decode(layer_id, q, iq, batch, pool, cfg, masks)
    return _extend(layer_id, q, iq, batch, pool, cfg)


# ---- decode: one query per row, fixed shapes -------------------------------------------------------------
def decode_masks(b: DecodeBatch, cfg: ModelConfig) -> tuple:
    """What every layer of a decode step reads alike, made once a step: each row's key count (its position + 1)
    and, with sparse layers where Triton's block kernel (it selects) does not run, the selection's `block_masks`."""
    if not cfg.any_sparse or triton_decode.serves(b.positions.device, cfg.head_dim, cfg.block_size):
        return b.positions + 1, None
    nb = -(-b.key_slots.shape[1] // cfg.block_size)
    return b.positions + 1, block_masks(b.positions[:, None], nb, cfg.block_size, cfg.topk_blocks, cfg.init_blocks,
                                        cfg.local_blocks)


def _decode(layer_id: int, q: torch.Tensor, iq: torch.Tensor | None, b: DecodeBatch, pool: MiniMaxSparseKVPool,
            cfg: ModelConfig, masks: tuple) -> tuple[torch.Tensor, torch.Tensor | None]:
    kind, rows, scale = cfg.layer_kinds[layer_id], q.shape[0], cfg.head_dim ** -0.5
    k_buf, v_buf = pool.get_kv_buffer(layer_id)
    lengths, selection = masks  # [B], block_masks
    qh = q.view(rows, cfg.num_kv_heads, -1, cfg.head_dim)  # [B, n_kv, G, D]: GQA group g = head // G
    if kind == "dense":
        o = decode_attention(qh, k_buf, v_buf, b.key_slots, lengths, scale)
    else:  # NOTE: for any context length: with at most K blocks visible, all are selected (model.md §3.3)
        scores = decode_block_scores(iq, pool.get_index_k_buffer(layer_id), b.key_slots, lengths, cfg.block_size)
        o = decode_sparse_attention(qh, k_buf, v_buf, b.key_slots, scores, b.positions, selection, cfg.block_size,
                                    cfg.topk_blocks, cfg.init_blocks, cfg.local_blocks, scale)
    u = None
    if kind == "sparse_index_kv":  # index-value branch: dense over the whole history (model.md §4)
        ik_buf, iv_buf = pool.get_index_kv_buffer(layer_id)
        u = decode_attention(iq[:, None], ik_buf, iv_buf, b.key_slots, lengths, cfg.index_head_dim ** -0.5)
    return o.reshape(rows, -1), None if u is None else u.reshape(rows, -1)


def sparse_attend(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, key_slots: torch.Tensor,
                  blocks: torch.Tensor, q_pos: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """Query r [R, n_q, D] at position q_pos[r] attends only to the keys of its blocks blocks[r] [n_kv, K] (model.md
    §3.4): K*B keys per query and KV head; key_slots [R, N]: each query's key slots (rows may share one)."""
    rows, n_kv = q.shape[0], k_buf.shape[1]
    qh = q.view(rows, n_kv, -1, q.shape[-1])
    return block_attention(qh, k_buf, v_buf, key_slots, blocks, q_pos, block_size, scale).reshape(rows, -1)


# ---- extend: each request a chunk of queries (a `Segment`) -----------------------------------------------------
def _causal_sdpa(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, segs: list[Segment], slots: torch.Tensor,
                 scale: float) -> list[torch.Tensor]:
    """Dense causal attention of each segment's queries (rows of q [T, heads, D]) over its keys (GQA) -> [queries,
    heads, D] each. NOTE: keys gathered at once, outputs as views for one `cat`: 684 vs 1,013 kernels a step."""
    k_all, v_all, outs, at = k_buf[slots], v_buf[slots], [], 0
    for seg in segs:
        k, v = (x[at:at + seg.num_keys].transpose(0, 1)[None] for x in (k_all, v_all))  # [1, n_kv, N, D]
        at += seg.num_keys
        qh = q[seg.start:seg.end].transpose(0, 1)[None]  # [1, heads, T, D]
        mask = seg.causal_bias(q.dtype) if seg.first_pos else None  # (a cached prefix: query t sees j <= first_pos + t)
        outs.append(F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, is_causal=mask is None, scale=scale,
                                                   enable_gqa=k.shape[1] != qh.shape[1])[0].transpose(0, 1))
    return outs


def _extend(layer_id: int, q: torch.Tensor, iq: torch.Tensor | None, batch: ForwardBatch, pool: MiniMaxSparseKVPool,
            cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor | None]:
    kind, segs, scale, t = cfg.layer_kinds[layer_id], batch.segments, cfg.head_dim ** -0.5, q.shape[0]
    k_buf, v_buf = pool.get_kv_buffer(layer_id)
    # (dense-equivalent: with at most K blocks of keys, all are selected; see _decode)
    dense = tuple(i for i, s in enumerate(segs) if kind == "dense" or s.num_keys <= cfg.topk_blocks * cfg.block_size)
    rows = (batch.query_rows if len(dense) == len(segs) > 1 and triton_decode.usable(q, k_buf, cfg.index_head_dim)
            and batch.key_table is not None and t * batch.key_table.shape[1] <= ROW_KEYS else None)
    if rows:
        out = decode_attention(q.view(t, k_buf.shape[1], -1, q.shape[-1]), k_buf, v_buf, *rows, scale)
    else:
        o: dict[int, torch.Tensor] = {}
        for run in _runs(dense, segs):
            o.update(zip(run, _causal_sdpa(q, k_buf, v_buf, [segs[i] for i in run], batch.slots_of(run), scale)))
        for i, seg in enumerate(segs):
            if i not in o:  # (block-sparse: past the top-k budget)
                o[i] = _sparse_segment(layer_id, q[seg.start:seg.end], iq[seg.start:seg.end], seg, pool, cfg, k_buf,
                                       v_buf).view(seg.queries, q.shape[1], -1)
        out = torch.cat([o[i] for i in range(len(segs))])
    if kind != "sparse_index_kv":
        return out.reshape(t, -1), None
    ik_buf, iv_buf = pool.get_index_kv_buffer(layer_id)  # index-value branch: dense causal over the whole history (§4)
    if rows:
        u = decode_attention(iq[:, None], ik_buf, iv_buf, *rows, cfg.index_head_dim ** -0.5)
        return out.reshape(t, -1), u.reshape(t, -1)
    u: list[torch.Tensor] = []
    for run in _runs(tuple(range(len(segs))), segs):
        u += _causal_sdpa(iq, ik_buf, iv_buf, [segs[i] for i in run], batch.slots_of(run), cfg.index_head_dim ** -0.5)
    return out.reshape(t, -1), torch.cat(u).reshape(t, -1)


def _runs(idx: tuple[int, ...], segs: list[Segment]) -> list[tuple[int, ...]]:
    """Segments `idx` in consecutive runs whose keys sum to at most GATHER_KEYS (a longer segment alone)."""
    runs, run, keys = [], (), 0
    for i in idx:
        if run and keys + segs[i].num_keys > GATHER_KEYS:
            runs, run, keys = runs + [run], (), 0
        run, keys = run + (i,), keys + segs[i].num_keys
    return runs + [run] if run else runs


def _sparse_segment(layer_id: int, q: torch.Tensor, iq: torch.Tensor, seg: Segment, pool: MiniMaxSparseKVPool,
                    cfg: ModelConfig, k_buf: torch.Tensor, v_buf: torch.Tensor) -> torch.Tensor:
    """A segment's block-sparse attention, its queries in chunks of QUERY_CHUNK -> [queries, n_q * D]."""
    ik = pool.get_index_k_buffer(layer_id)[seg.slots][:, 0]  # [N, D_I]
    chunks = [(a, min(a + QUERY_CHUNK, seg.queries)) for a in range(0, seg.queries, QUERY_CHUNK)]
    return torch.cat([_sparse_chunk(q[a:b], iq[a:b], ik, k_buf, v_buf, seg, a, b, cfg) for a, b in chunks])


def _sparse_chunk(q: torch.Tensor, iq: torch.Tensor, ik: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                  seg: Segment, a: int, b: int, cfg: ModelConfig) -> torch.Tensor:
    """The indexer and block-sparse attention for the segment's queries a..b-1 (`sparse_attend`: each query's K*B keys
    read from the pool). NOTE: on CPU read in place: a 4k-token prefill 1.4-1.7 vs 2.5 s gathering the blocks."""
    q_pos, scale = seg.q_pos(a, b), cfg.head_dim ** -0.5  # [1, T]
    first, n = seg.first_pos + a, seg.first_pos + b  # (keys before the chunk's first: all see; the chunk's last sees n)
    visible = torch.arange(first, n, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [1, T, n - first]
    scores = block_scores(iq[None], ik[None, :n], visible, cfg.block_size)  # [1, n_kv, T, nb]
    blocks = select_blocks(scores, block_masks(q_pos, scores.shape[-1], cfg.block_size, cfg.topk_blocks,
                                               cfg.init_blocks, cfg.local_blocks))[0].transpose(0, 1)  # [T, n_kv, K]
    keys = seg.slots[None, :n].expand(q.shape[0], -1)
    return sparse_attend(q, k_buf, v_buf, keys, blocks, q_pos[0], cfg.block_size, scale)
