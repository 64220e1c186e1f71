"""The lightning indexer's block scoring and top-k block selection (model.md §3.2-§3.3).

Prefill, chunked prefill and decode all call `select_blocks`, so every path selects identically.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


def block_scores(iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor, block_size: int) -> torch.Tensor:
    """Per-block max of the index scores over keys j <= p_t, fp32, no scale (model.md §3.2).

    iq [R, T, H, D_I] (normed, rotated index queries), ik [R, N, D_I] (cached index keys), q_pos [R, T]
    -> [R, H, T, nb]. Only the query's own block needs the token-level causal mask (blocks before it
    are wholly visible); it is recomputed causally. Blocks after it keep unmasked values, which
    `select_blocks` never reads (they are not visible).
    """
    r, t, h, d = iq.shape
    n, b = ik.shape[1], block_size
    if t == 1:
        return _decode_block_scores(iq, ik, q_pos, b)
    # one batched matmul per row; heads x queries share it, so no key tensor is expanded or copied
    scores = torch.matmul(iq.float().reshape(r, t * h, d), ik.float().transpose(1, 2))  # [R, T*H, N]
    scores = scores.view(r, t, h, n).transpose(1, 2)  # [R, H, T, N]
    full = n // b
    parts = [scores[..., : full * b].unflatten(-1, (full, b)).amax(dim=-1)] if full else []
    if n > full * b:  # the last, partial block
        parts.append(scores[..., full * b:].amax(dim=-1, keepdim=True))
    blocks = torch.cat(parts, dim=-1) if len(parts) > 1 else parts[0]
    own = q_pos // b  # [R, T]
    cols = own[..., None] * b + torch.arange(b, device=iq.device)  # [R, T, B]
    own_scores = scores.gather(-1, cols.clamp(max=n - 1).unsqueeze(1).expand(r, h, t, b))
    own_scores = own_scores.masked_fill((cols > q_pos[..., None]).unsqueeze(1), NEG_INF)
    blocks.scatter_(-1, own[:, None, :, None].expand(r, h, t, 1), own_scores.amax(dim=-1, keepdim=True))
    return blocks


def _decode_block_scores(iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor, b: int) -> torch.Tensor:
    """`block_scores` for one query per row (decode), in a handful of ops: keys after each row's
    query (padding of shorter rows) and the partial last block are set to -inf, then one block max."""
    r, _, h, d = iq.shape
    n = ik.shape[1]
    nb = -(-n // b)
    scores = torch.matmul(iq.float().view(r, h, d), ik.float().transpose(1, 2))  # [R, H, N]
    if nb * b != n:
        scores = F.pad(scores, (0, nb * b - n), value=NEG_INF)
    if r > 1:  # rows shorter than the longest: their padding keys must not count
        hidden = torch.arange(nb * b, device=iq.device)[None, :] > q_pos  # [R, nb*B]
        scores = scores.masked_fill(hidden[:, None, :], NEG_INF)
    return scores.view(r, h, nb, b).amax(dim=-1).unsqueeze(2)  # [R, H, 1, nb]


def select_blocks(block: torch.Tensor, q_pos: torch.Tensor, block_size: int, topk: int,
                  init_blocks: int, local_blocks: int) -> torch.Tensor:
    """Top-k key blocks per query and per index head, forced init/local blocks inside the budget.

    block [R, H, T, nb] from `block_scores` (only blocks up to the query's own are read); q_pos
    [R, T]. Returns [R, H, T, topk] int64 block ids, left-packed, -1 in unused slots. Ties go to the
    lower block id (stable descending sort).
    """
    nb = block.shape[-1]
    visible = (q_pos // block_size + 1)[:, :, None]  # V_t, [R, T, 1]
    b = torch.arange(nb, device=block.device)[None, None, :]
    forced = (b < torch.clamp(visible, max=init_blocks)) | (b >= visible - local_blocks)
    key = block.masked_fill(forced[:, None], float("inf")).masked_fill((b >= visible)[:, None], NEG_INF)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :topk]
    if nb < topk:
        order = torch.nn.functional.pad(order, (0, topk - nb), value=-1)
    count = torch.clamp(visible, max=topk)  # |S| = min(K, V_t), [R, T, 1]
    unused = torch.arange(topk, device=block.device)[None, None, :] >= count
    return order.masked_fill(unused[:, None], -1)


def select_one_query(block: torch.Tensor, pos: int, block_size: int, topk: int, init_blocks: int,
                     local_blocks: int) -> torch.Tensor:
    """`select_blocks` for a single query (one decode row) at position `pos`, known on the host:
    the same ids in the same order, with the visibility arithmetic done in Python (a few ops, not ~20)."""
    visible = pos // block_size + 1
    key = block[..., :visible].clone()  # [1, H, 1, V]: only visible blocks compete
    key[..., :min(init_blocks, visible)] = float("inf")
    key[..., max(visible - local_blocks, 0):] = float("inf")
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :topk]
    return F.pad(order, (0, topk - visible), value=-1) if visible < topk else order
