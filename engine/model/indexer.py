"""The lightning indexer's block scores and top-k block selection (model.md §3.2-§3.3). Extend and decode call the
same two functions, so every path selects identically; both are fixed-shape tensor code with no host sync."""

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


def block_scores(iq: torch.Tensor, ik: torch.Tensor, visible: torch.Tensor, block_size: int) -> torch.Tensor:
    """s[r, h, t, b] = max over keys j of block b that query t may see of iq[r, t, h] . ik[r, j] (fp32, no scale), -inf
    if none (model.md §3.2) -> [R, H, T, ceil(N / block_size)]. iq [R, T, H, D_I] (normed, rotated), ik [R, N, D_I],
    visible [R, T, V] bool for the last V keys (causal, False on padding); all see the first N - V (an extend chunk's
    past. NOTE: masking only the chunk's keys: ~3x cheaper at 4k)."""
    (r, t, h, _), n, pad = iq.shape, ik.shape[1], -ik.shape[1] % block_size
    ik = F.pad(ik.float(), (0, 0, 0, pad)) if pad else ik.float()  # (zero keys past the end, masked below)
    seen = F.pad(visible, (0, pad), value=False) if pad else visible  # [R, T, V + pad]
    scores = torch.matmul(iq.float().transpose(1, 2), ik.transpose(1, 2)[:, None])  # [R, H, T, N + pad]
    if visible.shape[-1] == n:  # (decode: a mask for every key; no in-place write to a slice, cheaper to trace)
        scores = torch.where(seen[:, None], scores, NEG_INF)
    else:
        scores[..., n - visible.shape[-1]:].masked_fill_(~seen[:, None], NEG_INF)
    return scores.view(r, h, t, -1, block_size).amax(dim=-1)


def block_masks(q_pos: torch.Tensor, nb: int, block_size: int, topk: int, init_blocks: int,
                local_blocks: int) -> tuple[torch.Tensor, ...]:
    """What `select_blocks` reads of queries at q_pos [R, T] over nb blocks, alike for every layer: whether a block is
    chosen on its score [R, 1, T, nb], its key if not (+inf: forced in, -inf: past the query's block V_t), the result
    slots left unused [R, 1, T, topk] (|S| = min(K, V_t)), the tie-break nb - 1 - b [nb]."""
    visible = (q_pos // block_size + 1)[:, :, None]  # V_t, [R, T, 1]
    b = torch.arange(nb, device=q_pos.device)[None, None, :]
    hidden, forced = b >= visible, (b < init_blocks) | (b >= visible - local_blocks)
    unused = torch.arange(topk, device=q_pos.device)[None, None, :] >= visible
    return (~(forced | hidden)[:, None], torch.where(hidden, NEG_INF, float("inf"))[:, None], unused[:, None],
            torch.arange(nb - 1, -1, -1, device=q_pos.device))


def select_blocks(block: torch.Tensor, masks: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Top-k key blocks per query and per index head, forced init/local blocks inside the budget: block [R, H, T,
    nb] from `block_scores` (only blocks up to the query's own are read), under the queries' `block_masks`.
    Returns [R, H, T, topk] int64 block ids, left-packed, -1 in unused slots. Ties go to the lower block id."""
    scored, forced_key, unused, tie_break = masks
    nb, topk = block.shape[-1], unused.shape[-1]
    order = torch.topk(_tie_broken(torch.where(scored, block, forced_key), tie_break), min(topk, nb), dim=-1).indices
    if nb < topk:  # (what a stable descending sort gives)
        order = F.pad(order, (0, topk - nb), value=-1)
    return order.masked_fill(unused, -1)


def _tie_broken(key: torch.Tensor, tie_break: torch.Tensor) -> torch.Tensor:
    """float32 keys [..., nb] as int64 keys in the same order, ties toward the lower index: monotone float bits (-0.0 =
    0.0) * nb + tie_break (nb - 1 - index). NOTE: top-k of these, not a stable sort: 1.5 vs 1.7 ms a step."""
    assert key.dtype == torch.float32, key.dtype  # (block_scores computes in fp32)
    bits = key.contiguous().view(torch.int32).to(torch.int64)
    monotone = torch.where(bits < 0, -2**31 - bits, bits)  # (-0.0's bits, -2**31, become 0)
    return torch.add(tie_break, monotone, alpha=key.shape[-1])  # (monotone * nb + tie_break: one kernel)
