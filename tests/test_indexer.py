"""The lightning indexer's block scores and block selection against their definitions (model.md §3)."""

from __future__ import annotations

import pytest
import torch

from engine.model.indexer import block_masks, block_scores, select_blocks


def _visible(n: int, q_pos: torch.Tensor) -> torch.Tensor:
    return torch.arange(n)[None, None, :] <= q_pos[:, :, None]


@pytest.mark.parametrize("n,t,block", [(37, 37, 4), (100, 9, 16), (64, 1, 8), (5, 5, 8)])
def test_block_scores_equal_causal_token_max(n, t, block):
    g = torch.Generator().manual_seed(n)
    iq, ik = torch.randn(2, t, 3, 8, generator=g), torch.randn(2, n, 8, generator=g)
    q_pos = torch.arange(n - t, n).expand(2, t)
    got = block_scores(iq, ik, _visible(n, q_pos), block)
    for r in range(2):
        for h in range(3):
            for ti in range(t):
                p = int(q_pos[r, ti])
                for b in range(p // block + 1):  # blocks up to the query's own
                    keys = range(b * block, min((b + 1) * block, p + 1))
                    want = max(float(iq[r, ti, h] @ ik[r, j]) for j in keys)
                    assert abs(float(got[r, h, ti, b]) - want) < 1e-5


def test_selection_rules():
    g = torch.Generator().manual_seed(0)
    block, topk, init, local = 4, 4, 1, 2
    q_pos = torch.arange(0, 60).view(1, -1)
    nb = 15
    scores = torch.randn(1, 2, 60, nb, generator=g)
    sel = select_blocks(scores, block_masks(q_pos, nb, block, topk, init, local))
    for h in range(2):
        for t in range(60):
            visible = t // block + 1
            chosen = [b for b in sel[0, h, t].tolist() if b >= 0]
            assert len(chosen) == min(topk, visible) == len(set(chosen))
            assert all(b < visible for b in chosen) and (visible - 1) in chosen
            forced = {b for b in range(visible) if b < min(init, visible) or b >= visible - local}
            assert forced <= set(chosen)
            rest = sorted((b for b in range(visible) if b not in forced), key=lambda b: (-float(scores[0, h, t, b]), b))
            assert set(chosen) == forced | set(rest[: len(chosen) - len(forced)])
    tied = select_blocks(torch.zeros(1, 1, 1, 8), block_masks(torch.tensor([[31]]), 8, block, 3, 0, 1))
    assert tied[0, 0, 0].tolist() == [7, 0, 1]  # equal scores: the lower block id wins
    # exactly a stable descending sort's order, ties (-0.0 and 0.0 equal) and infinities included
    values = torch.tensor([0.0, -0.0, 1.5, -2.0, 1.5, float("-inf"), -2.0, 3.0e38, -1e-45, 0.0, 1e-45, -0.0])
    keys = values[torch.randint(0, len(values), (3, 2, 50, 24), generator=g)]
    q_pos = torch.randint(0, 24 * block, (3, 50), generator=g)
    got = select_blocks(keys, block_masks(q_pos, 24, block, 6, 1, 1))
    visible = (q_pos // block + 1)[:, None, :, None]
    b = torch.arange(24)
    forced = (b < torch.clamp(visible, max=1)) | (b >= visible - 1)
    ref = keys.masked_fill(forced, float("inf")).masked_fill(b >= visible, float("-inf"))
    want = torch.sort(ref, dim=-1, descending=True, stable=True).indices[..., :6]
    want = want.masked_fill(torch.arange(6) >= torch.clamp(visible, max=6), -1)
    assert torch.equal(got, want)


def test_decode_block_scores_rows_of_different_lengths():
    """One query per row, rows padded to the longest: each row's blocks see only its own keys."""
    g = torch.Generator().manual_seed(3)
    n, block = 100, 16
    iq, ik = torch.randn(3, 1, 2, 8, generator=g), torch.randn(3, n, 8, generator=g)
    q_pos = torch.tensor([[37], [99], [63]])
    got = block_scores(iq, ik, _visible(n, q_pos), block)
    assert got.shape == (3, 2, 1, -(-n // block))
    for r in range(3):
        p = int(q_pos[r, 0])
        for h in range(2):
            for b in range(p // block + 1):
                want = max(float(iq[r, 0, h] @ ik[r, j]) for j in range(b * block, min((b + 1) * block, p + 1)))
                assert abs(float(got[r, h, 0, b]) - want) < 1e-5


@pytest.mark.parametrize("n", [64, 70])
def test_decode_block_scores_one_row(n):
    """A single decode row (its own matmul layout), whole blocks only and with a partial last block."""
    g = torch.Generator().manual_seed(n)
    block, p = 16, n - 1
    iq, ik = torch.randn(1, 1, 2, 8, generator=g), torch.randn(1, n, 8, generator=g)
    got = block_scores(iq, ik, _visible(n, torch.tensor([[p]])), block)
    assert got.shape == (1, 2, 1, -(-n // block))
    for h in range(2):
        for b in range(p // block + 1):
            want = max(float(iq[0, 0, h] @ ik[0, j]) for j in range(b * block, min((b + 1) * block, p + 1)))
            assert abs(float(got[0, h, 0, b]) - want) < 1e-5
