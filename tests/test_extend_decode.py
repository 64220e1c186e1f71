"""Paged extend/decode against a single full forward, and block-sparse against dense attention."""

from __future__ import annotations

import pytest
import torch
from orig_checkpoint import make_config, random_state_dict, write_checkpoint
from test_parity_transformers import Ours, prompt_logits

from engine.model.attention import (
    block_sparse_attention,
    blocked_rows,
    dense_attention,
    gathered_sparse_attention,
    masked_sparse_attention,
)
from engine.model.forward_batch import Segment
from engine.model.indexer import select_blocks


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    cfg = make_config()
    return Ours(write_checkpoint(tmp_path_factory.mktemp("ckpt"), cfg, random_state_dict(cfg, seed=11)))


def run_steps(llm: Ours, prompts: list[list[int]], chunk: int, prefix: int | None = None) -> list[torch.Tensor]:
    """Each prompt `chunk` tokens per step (all batched), or a `prefix` extend then decode steps."""
    return llm.paged.run(prompts, chunk, prefix)


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 384, (n,), generator=g).tolist() for n in (150, 61, 9)]


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_chunked_extend_equals_full_forward(llm, chunk):
    full = [prompt_logits(llm, p) for p in prompts()]
    for got, want in zip(run_steps(llm, prompts(), chunk), full):
        assert (got - want).abs().max().item() < 1e-4


def test_decode_after_cached_prefix_equals_full_forward(llm):
    full = [prompt_logits(llm, p) for p in prompts()]
    for got, want in zip(run_steps(llm, prompts(), 0, prefix=5), full):
        assert (got - want).abs().max().item() < 1e-4


def _random_segment(n: int, t: int, perm: torch.Tensor) -> Segment:
    q_pos = torch.arange(n - t, n).view(1, -1)
    return Segment(0, 1, t, perm[:n].view(1, -1), q_pos, n - 1)


def block_path(q, k_buf, v_buf, blocks, seg, block, scale):
    """The one-row extend path: K/V copied once into block layout, whole blocks gathered."""
    return block_sparse_attention(q, blocked_rows(k_buf, seg, block), blocked_rows(v_buf, seg, block), blocks,
                                  seg, block, scale)


SPARSE_PATHS = [gathered_sparse_attention, masked_sparse_attention, block_path]


@pytest.mark.parametrize("sparse_attention", SPARSE_PATHS)
@pytest.mark.parametrize("block,n,t", [(4, 37, 37), (16, 100, 9), (8, 64, 1)])
def test_sparse_with_topk_covering_every_block_equals_dense(sparse_attention, block, n, t):
    g = torch.Generator().manual_seed(block)
    n_kv, group, d = 2, 3, 8
    k_buf, v_buf = torch.randn(300, n_kv, d, generator=g), torch.randn(300, n_kv, d, generator=g)
    seg = _random_segment(n, t, torch.randperm(300, generator=g))  # slots scattered over the pool
    q = torch.randn(t, n_kv * group, d, generator=g)
    scores = torch.randn(1, n_kv, t, -(-n // block), generator=g)  # block scores
    topk = -(-n // block)
    blocks = select_blocks(scores, seg.q_pos, block, topk, init_blocks=0, local_blocks=1)
    sparse = sparse_attention(q, k_buf, v_buf, blocks, seg, block, d ** -0.5)
    dense = dense_attention(q, k_buf, v_buf, seg, d ** -0.5)
    assert (sparse - dense).abs().max().item() < 1e-5
    # and with a smaller budget it is genuinely different (the test can fail)
    fewer = select_blocks(scores, seg.q_pos, block, 2, init_blocks=0, local_blocks=1)
    if n > 2 * block:
        assert (sparse_attention(q, k_buf, v_buf, fewer, seg, block, d ** -0.5) - dense).abs().max().item() > 1e-3


@pytest.mark.parametrize("sparse_attention", SPARSE_PATHS)
def test_sparse_attention_equals_masked_dense_reference(sparse_attention):
    """Both block-sparse paths equal a naive softmax over exactly the selected, causal keys."""
    g = torch.Generator().manual_seed(1)
    block, n, t, n_kv, group, d = 4, 45, 45, 2, 2, 8
    k_buf, v_buf = torch.randn(64, n_kv, d, generator=g), torch.randn(64, n_kv, d, generator=g)
    seg = _random_segment(n, t, torch.randperm(64, generator=g))
    q = torch.randn(t, n_kv * group, d, generator=g)
    blocks = select_blocks(torch.randn(1, n_kv, t, -(-n // block), generator=g), seg.q_pos, block, 3, 1, 1)
    got = sparse_attention(q, k_buf, v_buf, blocks, seg, block, d ** -0.5).view(t, n_kv, group, d)
    k, v = k_buf[seg.slots[0]], v_buf[seg.slots[0]]
    for h in range(n_kv):
        allowed = torch.zeros(t, n, dtype=torch.bool)
        for ti in range(t):
            for b in blocks[0, h, ti].tolist():
                if b >= 0:
                    allowed[ti, b * block:(b + 1) * block] = True
        allowed &= torch.tril(torch.ones(t, n, dtype=torch.bool))
        s = (q.view(t, n_kv, group, d)[:, h] @ k[:, h].T) * d ** -0.5  # [T, G, N]
        want = torch.softmax(s.masked_fill(~allowed[:, None], float("-inf")), -1) @ v[:, h]
        assert (got[:, h] - want).abs().max().item() < 1e-5
