"""Paged extend/decode against a single full forward, and block-sparse against dense attention."""

from __future__ import annotations

import pytest
import torch
from engine_utils import TINY
from orig_checkpoint import make_config, random_state_dict, write_checkpoint
from test_decode_static import _Kernels
from test_parity_transformers import Ours, prompt_logits

from engine.model import attention
from engine.model.attention import sparse_attend
from engine.model.forward_batch import ForwardBatch
from engine.model.indexer import block_masks, select_blocks
from engine.model.loader import load_model
from tests.forward_utils import PagedModel


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


def _slots(n: int, pool_rows: int, g: torch.Generator) -> torch.Tensor:
    return torch.randperm(pool_rows, generator=g)[:n]  # a sequence's slots scattered over the pool


def _dense(q, k_buf, v_buf, slots, q_pos, scale):
    """Causal softmax attention of q [T, n_kv*G, D] at q_pos over keys slots[:q_pos + 1], per query."""
    n_kv, t, d = k_buf.shape[1], q.shape[0], q.shape[-1]
    k, v = k_buf[slots], v_buf[slots]  # [N, n_kv, D]
    qh = q.view(t, n_kv, -1, d)
    s = torch.einsum("thgd,nhd->thgn", qh, k) * scale
    s = s.masked_fill(torch.arange(len(slots))[None, None, None, :] > q_pos[:, None, None, None], float("-inf"))
    return torch.einsum("thgn,nhd->thgd", torch.softmax(s, -1), v).reshape(t, -1)


@pytest.mark.parametrize("block,n,t", [(4, 37, 37), (16, 100, 9), (8, 64, 1)])
def test_sparse_with_topk_covering_every_block_equals_dense(block, n, t):
    g = torch.Generator().manual_seed(block)
    n_kv, group, d = 2, 3, 8
    k_buf, v_buf = torch.randn(300, n_kv, d, generator=g), torch.randn(300, n_kv, d, generator=g)
    slots = _slots(n, 300, g)
    q = torch.randn(t, n_kv * group, d, generator=g)
    q_pos = torch.arange(n - t, n)
    scores = torch.randn(1, n_kv, t, -(-n // block), generator=g)  # block scores
    topk = -(-n // block)
    blocks = select_blocks(scores, block_masks(q_pos[None], scores.shape[-1], block, topk, 0, 1))[0].transpose(0, 1)
    keys = slots[None].expand(t, -1)
    sparse = sparse_attend(q, k_buf, v_buf, keys, blocks, q_pos, block, d ** -0.5)
    dense = _dense(q, k_buf, v_buf, slots, q_pos, d ** -0.5)
    assert (sparse - dense).abs().max().item() < 1e-5
    # and with a smaller budget it is genuinely different (the test can fail)
    fewer = select_blocks(scores, block_masks(q_pos[None], scores.shape[-1], block, 2, 0, 1))[0].transpose(0, 1)
    if n > 2 * block:
        assert (sparse_attend(q, k_buf, v_buf, keys, fewer, q_pos, block, d ** -0.5) - dense).abs().max().item() > 1e-3


def test_sparse_attention_equals_masked_dense_reference():
    """Block-sparse attention (each query's selected keys read through the pool's slots) equals a naive softmax
    over exactly the selected, causal keys."""
    g = torch.Generator().manual_seed(1)
    block, n, t, n_kv, group, d = 4, 45, 45, 2, 2, 8
    k_buf, v_buf = torch.randn(64, n_kv, d, generator=g), torch.randn(64, n_kv, d, generator=g)
    slots = _slots(n, 64, g)
    q = torch.randn(t, n_kv * group, d, generator=g)
    q_pos = torch.arange(t)
    nb = -(-n // block)
    blocks = select_blocks(torch.randn(1, n_kv, t, nb, generator=g), block_masks(q_pos[None], nb, block, 3, 1, 1))[0]
    got = sparse_attend(q, k_buf, v_buf, slots[None].expand(t, -1), blocks.transpose(0, 1), q_pos, block,
                        d ** -0.5).view(t, n_kv, group, d)
    k, v = k_buf[slots], v_buf[slots]
    for h in range(n_kv):
        allowed = torch.zeros(t, n, dtype=torch.bool)
        for ti in range(t):
            for b in blocks[h, ti].tolist():
                if b >= 0:
                    allowed[ti, b * block:(b + 1) * block] = True
        allowed &= torch.tril(torch.ones(t, n, dtype=torch.bool))
        s = (q.view(t, n_kv, group, d)[:, h] @ k[:, h].T) * d ** -0.5  # [T, G, N]
        want = torch.softmax(s.masked_fill(~allowed[:, None], float("-inf")), -1) @ v[:, h]
        assert (got[:, h] - want).abs().max().item() < 1e-5


def test_an_extend_adds_one_kernel_a_request_and_attention_and_reads_nothing_back():
    """An extend step's kernels (counted as test_decode_static counts a decode step's) grow by one a request per
    attention call (its SDPA: the keys of all the requests gathered at once, the outputs joined by one cat) and one
    for its slots; and a prefill past the top-k budget (selection runs, in chunks of queries) reads nothing back to
    the host (`.item()`: on a GPU a sync each, which stops the host from queuing the step's kernels ahead)."""
    model = load_model(TINY)
    kinds = model.cfg.layer_kinds
    calls = len(kinds) + kinds.count("sparse_index_kv")  # (the index-value branch attends too)

    def counted(prompts: list[list[int]]) -> _Kernels:
        paged = PagedModel(model, size=sum(map(len, prompts)) + 64, max_requests=len(prompts))
        kvs = [paged.kv.admit([]) for _ in prompts]
        with torch.no_grad(), _Kernels() as k:
            paged.step(kvs, prompts)
        return k

    four, eight = (counted([[7 + i] * 64 for i in range(r)]) for r in (4, 8))
    assert eight.kernels() - four.kernels() <= 4 * (calls + 1), (four.kernels(), eight.kernels())  # (exactly, today)
    long = counted([list(range(10, 710)), [5] * 40])
    assert "topk" in long.ops and "_local_scalar_dense" not in long.ops


def test_requests_gathered_in_runs_give_the_logits_of_one_gather(monkeypatch):
    """An extend's dense attention gathers its requests' keys in runs of at most GATHER_KEYS (requests sharing a long
    cached prefix would otherwise each copy it at once): runs of one request give the same logits as one run."""
    model = load_model(TINY)
    prompts = [[(7 * j + i) % 3000 + 20 for j in range(n)] for i, n in enumerate((90, 300, 12, 64))]

    def logits() -> list[torch.Tensor]:
        paged = PagedModel(model, size=1024, max_requests=4)
        return paged.step([paged.kv.admit([]) for _ in prompts], prompts)

    together = logits()
    monkeypatch.setattr(attention, "GATHER_KEYS", 1)  # (every request a run of its own)
    assert all(torch.equal(a, b) for a, b in zip(together, logits()))


def test_an_extend_gives_each_request_its_solo_logits_with_or_without_the_key_table():
    """The extend's key table (one gather for all requests) is kept unless padding would fill over half of it (a long
    request among short ones: each its own slots). Batched either way, each request's logits are its solo ones."""
    model = load_model(TINY)
    for lengths, kept in (((300, 250, 280), True), ((700, 9, 10, 30), False)):
        prompts = [[(5 * j + i) % 3000 + 20 for j in range(n)] for i, n in enumerate(lengths)]
        paged = PagedModel(model, size=2048, max_requests=8)
        kvs = [paged.kv.admit([]) for _ in prompts]
        loc = paged.kv.allocate([(kv, len(p)) for kv, p in zip(kvs, prompts)])
        batch = ForwardBatch.build([kv.row for kv in kvs], [0] * len(kvs), prompts, loc, paged.kv.table, loc.device)
        assert (batch.key_table is not None) == kept
        together = paged.step([paged.kv.admit([]) for _ in prompts], prompts)
        for p, got in zip(prompts, together):
            torch.testing.assert_close(got, PagedModel(model, size=1024, max_requests=1).logits(p), atol=1e-5, rtol=0)
