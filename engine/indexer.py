"""The lightning indexer's block scoring and top-k block selection (model.md §3.2-§3.3).

Prefill, chunked prefill and decode all call `select_blocks`, so every path selects identically.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def token_scores(iq: torch.Tensor, ik: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
    """Causally masked index scores in fp32, no scale (model.md §3.2).

    iq [R, T, H, D_I] (normed, rotated index queries), ik [R, N, D_I] (cached index keys),
    q_pos [R, T] -> [R, H, T, N] with -inf at every key position later than the query.
    """
    scores = torch.einsum("rthd,rnd->rhtn", iq.float(), ik.float())
    future = torch.arange(ik.shape[1], device=ik.device)[None, None, :] > q_pos[:, :, None]
    return scores.masked_fill(future[:, None], NEG_INF)


def select_blocks(scores: torch.Tensor, q_pos: torch.Tensor, block_size: int, topk: int,
                  init_blocks: int, local_blocks: int) -> torch.Tensor:
    """Top-k key blocks per query and per index head, forced init/local blocks inside the budget.

    scores [R, H, T, N] from `token_scores`; q_pos [R, T]. Returns [R, H, T, topk] int64 block ids,
    left-packed, -1 in unused slots. Ties go to the lower block id (stable descending sort).
    """
    r, h, t, n = scores.shape
    nb = -(-n // block_size)
    pad = nb * block_size - n
    if pad:
        scores = torch.nn.functional.pad(scores, (0, pad), value=NEG_INF)
    block = scores.view(r, h, t, nb, block_size).amax(dim=-1)  # [R, H, T, nb]

    visible = (q_pos // block_size + 1)[:, :, None]  # V_t, [R, T, 1]
    b = torch.arange(nb, device=scores.device)[None, None, :]
    forced = (b < torch.clamp(visible, max=init_blocks)) | (b >= visible - local_blocks)
    key = block.masked_fill(forced[:, None], float("inf")).masked_fill((b >= visible)[:, None], NEG_INF)
    order = torch.sort(key, dim=-1, descending=True, stable=True).indices[..., :topk]
    if nb < topk:
        order = torch.nn.functional.pad(order, (0, topk - nb), value=-1)
    count = torch.clamp(visible, max=topk)  # |S| = min(K, V_t), [R, T, 1]
    unused = torch.arange(topk, device=scores.device)[None, None, :] >= count
    return order.masked_fill(unused[:, None], -1)
