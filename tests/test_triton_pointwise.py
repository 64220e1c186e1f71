"""Triton's pointwise kernels (engine/kernels/triton_pointwise.py) and the decode step's block selection
(in triton_decode's block kernel), compiled on a GPU (`make bench-gpu` runs this file) and run by Triton's interpreter
elsewhere: against layers.py's and indexer.py's PyTorch forms, in float32 (to its rounding) and bfloat16 (the kernels
round once, the PyTorch forms between steps: within bf16's rounding), at widths that are and are not powers of two.
A whole decode step through every kernel: tests/test_triton_decode.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.kernels import triton_decode, triton_indexer
from engine.kernels import triton_pointwise as fused
from engine.model import layers
from engine.model.indexer import block_masks, select_blocks
from engine.runtime import sampler
from tests.engine_utils import make_engine, run_all, submit
from tests.test_layers import _moe, _moe_reference

pytestmark = [pytest.mark.usefixtures("no_failed_launch"),
              pytest.mark.skipif(fused.triton is None, reason="Triton is not installed")]
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# NOTE: the references are layers.py's PyTorch forms whatever the device: tests run with grad enabled, where
# `fused.serves` is False (the kernels are called as ops directly).
def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    assert got.dtype == want.dtype == dtype and got.shape == want.shape
    tol = {"atol": 2e-5, "rtol": 2e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1.6e-2}
    torch.testing.assert_close(got.float(), want.float(), **tol)


def _randn(*shape: int, g: torch.Generator, scale: float = 1.0, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [256, 200])
def test_rms_norm_kernels_equal_the_pytorch_forms(dtype, n):
    """The norm alone, and with the residual add before it; in float32 for the MoE's router (the same values)."""
    g = torch.Generator().manual_seed(0)
    x, w = _randn(3, 5, n, g=g, scale=3.0, dtype=dtype), _randn(n, g=g, scale=0.2, dtype=dtype)
    _close(fused.rms_norm(x, w, 1e-6), layers.rms_norm(x, w, 1e-6), dtype)
    delta = _randn(3, 5, n, g=g, scale=3.0, dtype=dtype)
    h, normed = fused.add_rms_norm(x, delta, w, 1e-6)
    _close(h, x + delta, dtype)  # (on a GPU, bit for bit: Triton's interpreter truncates to bf16, a GPU rounds)
    assert DEVICE == "cpu" or torch.equal(h, x + delta)
    _close(normed, layers.add_rms_norm(x, delta, w, 1e-6)[1], dtype)
    wide = fused.add_rms_norm(x, delta, w, 1e-6, torch.float32)[1]
    assert wide.dtype == torch.float32 and torch.equal(wide, normed.float())
    assert torch.equal(layers.add_rms_norm(x, delta, w, 1e-6, torch.float32)[1], layers.add_rms_norm(
        x, delta, w, 1e-6)[1].float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,first,d,rotary", [(10, 8, 32, 16), (3, 2, 32, 16), (20, 16, 128, 64), (2, 1, 64, 64)])
def test_norm_rope_kernel_equals_the_pytorch_form(dtype, heads, first, d, rotary):
    """Rows strided as in a layer (the q|k columns of the fused projection's output), positions up to 60k."""
    g = torch.Generator().manual_seed(1)
    y = _randn(7, heads * d + 96, g=g, scale=2.0, dtype=dtype)[:, :heads * d]
    w1, w2 = _randn(d, g=g, scale=0.3, dtype=dtype), _randn(d, g=g, scale=0.3, dtype=dtype)
    rot = layers.rope_rotation(torch.randint(0, 60000, (7,), generator=g).to(DEVICE),
                               layers.rope_inv_freq(rotary, 1e6).to(DEVICE), dtype)
    _close(fused.norm_rope(y, w1, w2, first, rot, 1e-6), layers.norm_rope(y, w1, w2, first, rot, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("inter", [256, 96, 1536])  # (1536: two column programs, the second partly masked)
def test_swiglu_kernel_equals_the_pytorch_form(dtype, inter):
    g = torch.Generator().manual_seed(2)
    gate_up = _randn(4, 2, 2 * inter, g=g, scale=5.0, dtype=dtype)  # (values past the limit, +-7, on both halves)
    _close(fused.swiglu_oai(gate_up, 1.702, 7.0), layers.swiglu_oai(gate_up, 1.702, 7.0), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,first,d,values", [(10, 8, 32, 2), (3, 2, 32, 1), (3, 2, 32, 0), (20, 16, 128, 4),
                                                  (6, 4, 64, 20)])  # (20 x 64 values: two tiles a row)
def test_norm_rope_kernel_writes_keys_and_values_as_the_pytorch_form(dtype, heads, first, d, values):
    """With a layer's buffers: the keys (heads >= first) at rows `loc` (every other entry of a longer vector) of k_buf,
    and the values (a strided slice, as of the fused projection; none for a K-only layer) at v_buf's; no other row
    touched."""
    g = torch.Generator().manual_seed(6)
    y = _randn(5, heads * d + 40, g=g, scale=2.0, dtype=dtype)[:, :heads * d]
    w1, w2 = _randn(d, g=g, scale=0.3, dtype=dtype), _randn(d, g=g, scale=0.3, dtype=dtype)
    rot = layers.rope_rotation(torch.randint(0, 60000, (5,), generator=g).to(DEVICE),
                               layers.rope_inv_freq(d // 2, 1e6).to(DEVICE), dtype)
    v = _randn(5, values * d + 24, g=g, dtype=dtype)[:, 8:8 + values * d].view(5, values, d) if values else None
    loc = torch.tensor([7, 0, 2, 0, 9, 0, 4, 0, 1], device=DEVICE)[::2]
    got = [_randn(12, heads - first, d, g=g, dtype=dtype)] + ([_randn(12, values, d, g=g, dtype=dtype)] if values
                                                               else [None])
    want = [None if b is None else b.clone() for b in got]
    _close(fused.norm_rope(y, w1, w2, first, rot, 1e-6, *got, loc, v),
           layers.norm_rope(y, w1, w2, first, rot, 1e-6, *want, loc, v), dtype)
    _close(got[0], want[0], dtype)
    others = [i for i in range(12) if i not in loc.tolist()]
    assert torch.equal(got[0][others], want[0][others]) and (not values or torch.equal(got[1], want[1]))


@pytest.mark.parametrize("experts,k", [(8, 2), (64, 4), (256, 8), (48, 6)])
def test_route_kernel_equals_the_pytorch_form(experts, k):
    g = torch.Generator().manual_seed(3)
    logits, bias = _randn(9, experts, g=g, scale=2.0), _randn(experts, g=g, scale=0.1)
    ids, w = fused.route(logits, bias, k, 2.5)  # (weights scaled: the MoE's gamma)
    want_ids, want_w = layers.route(logits, bias, k, 2.5)
    torch.testing.assert_close(w.sum(dim=-1), torch.full_like(w[:, 0], 2.5))
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(w, want_w, atol=1e-6, rtol=1e-6)
    tied, _ = fused.route(torch.zeros(2, experts, device=DEVICE), torch.zeros(experts, device=DEVICE), k, 1.0)
    assert tied.tolist() == [list(range(k))] * 2  # (equal keys: the lower ids, in order)


@pytest.mark.parametrize("block_size,topk,init,local", [(64, 4, 1, 1), (16, 6, 0, 1), (64, 8, 2, 2)])
def test_the_block_kernel_selects_as_select_blocks(block_size, topk, init, local):
    """The decode step's block attention choosing its blocks from the block scores itself: as over `select_blocks`'
    blocks, bit for bit (the same blocks in the same order), and as the C kernel over them (after a failure). Rows
    from one visible block to all nb, heads with tied scores (zeros, and -0.0 beside 0.0)."""
    g, nb = torch.Generator().manual_seed(4), 40
    q_pos = torch.tensor([0, block_size - 1, block_size, 3 * block_size + 5, 20 * block_size, nb * block_size - 1])
    scores = torch.randn(len(q_pos), 3, nb, generator=g)
    scores[:, 1] = 0.0
    scores[:, 2, ::2] = -0.0
    q, (k, v) = torch.randn(len(q_pos), 3, 2, 32, generator=g), (torch.randn(5000, 3, 32, generator=g) for _ in "kv")
    key_slots = torch.randint(0, 5000, (len(q_pos), nb * block_size), generator=g)
    args = [x.to(DEVICE) for x in (q, k, v, key_slots, scores, q_pos)]
    got = triton_indexer._select_attend(*args, block_size, topk, init, local, 0.2)
    blocks = select_blocks(args[4][:, :, None], block_masks(args[5][:, None], nb, block_size, topk, init, local))[:, :, 0]
    assert (blocks[0, :, 1:] == -1).all() and (blocks[-1] >= 0).all()
    assert torch.equal(got, triton_decode._block_attention(*args[:4], blocks, args[5], block_size, 0.2))
    torch.testing.assert_close(triton_indexer._selected_attention(*args, block_size, topk, init, local, 0.2), got,
                               atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,k,experts,hidden,inter,shared", [(3, 2, 8, 256, 256, 256), (1, 4, 64, 200, 96, 160),
                                                                   (5, 2, 4, 64, 300, 64), (2, 2, 8, 64, 96, 0)])
@pytest.mark.parametrize("tile", [16, 32, 64])
def test_expert_pair_kernels_equal_the_gathered_experts(dtype, tokens, k, experts, hidden, inter, shared, tile,
                                                        monkeypatch):
    """Hidden and intermediate sizes in and out of the kernels' blocks; experts shared by tokens (4 experts); the
    shared expert (one more pair a token) as wide as the experts, wider, narrower, or none; at each tile the GPU
    bench's moe_forms tries."""
    monkeypatch.setattr(fused, "EXPERT_TILE", tile)
    g = torch.Generator().manual_seed(6)
    x, w13, w2, s13, s2 = (_randn(*s, g=g, scale=f, dtype=dtype) for s, f in
                           (((tokens, hidden), 5.0), ((experts, 2 * inter, hidden), 0.1), ((experts, hidden, inter), 0.1),
                            ((2 * shared, hidden), 0.1), ((hidden, shared), 0.1)))
    s13, s2 = (s13, s2) if shared else (None, None)
    ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)]).to(DEVICE)
    w = torch.rand(tokens, k, generator=g).to(DEVICE)
    want = layers.gathered_experts(x.double(), ids, w.double(), w13.double(), w2.double(), 1.702, 7.0,
                                   *((s13.double(), s2.double()) if shared else ()))
    got = fused.gathered_experts(x, ids, w, w13, w2, 1.702, 7.0, s13, s2)  # (bf16: each pair's activations rounded, as the
    assert got.dtype == dtype  # grouped form's are)
    top = want.abs().max().item()  # (bf16: within its rounding of the largest outputs)
    tol = {"atol": 1e-6 * top, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2 * top, "rtol": 2e-2}
    torch.testing.assert_close(got.double(), want, **tol)


@pytest.mark.parametrize("pair_bytes", [64 << 20, -1 << 60])  # (Triton's pairs; the grouped form)
def test_an_moe_layer_through_the_kernels_equals_its_reference(pair_bytes, monkeypatch):
    """configs/tiny's MoE (8 experts, top-2) on 6 tokens, every Triton kernel it takes against model.md written out
    in float64 (test_layers' reference); the pairs while they read at most PAIR_BYTES more than the grouped form."""
    if DEVICE == "cuda" and pair_bytes < 0:
        pytest.skip("float32 on CUDA has no grouped form: always the pairs")
    moe, x = _moe(2, 0), torch.randn(6, 256, generator=torch.Generator().manual_seed(7))
    monkeypatch.setattr(triton_decode, "serves", lambda device, *dims: True)
    monkeypatch.setattr(layers, "on_kernel", lambda *a: False)  # (CPU float32's C kernel)
    monkeypatch.setattr(layers, "PAIR_BYTES", pair_bytes)
    calls, real = [], fused.gathered_experts
    monkeypatch.setattr(fused, "gathered_experts", lambda *a: calls.append(1) or real(*a))
    with torch.no_grad():
        got = moe.to(DEVICE)(x.to(DEVICE))
    assert len(calls) == (pair_bytes > 0)
    torch.testing.assert_close(got.double().cpu(), _moe_reference(moe.cpu(), x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("vocab", [3000, 4096])  # (tiles of 1024: the last one part masked, or whole)
def test_race_kernel_draws_the_samplers_tokens(vocab):
    """The race in log space, argmax(x / t - log E), against the sampler's argmax(softmax(x / t) / E): the same
    tokens for 256 rows (E from the same hashed bits; a near-tie could differ in the last bit, none here), greedy
    rows their argmax, banned tokens (-inf) never drawn."""
    g = torch.Generator().manual_seed(8)
    x = torch.randn(256, vocab, generator=g) * 3
    x[:, ::7] = float("-inf")
    seeds = sampler.seed_hash(torch.randint(0, 2**62, (256,), generator=g))
    pos, greedy = torch.randint(0, 10**6, (256,), generator=g), torch.rand(256, generator=g) < 0.2
    x[0], greedy[0] = 1.0, True  # (a greedy row of equal logits: the first, across tiles too)
    temperature = torch.where(greedy, 1.0, torch.rand(256, generator=g) * 1.5 + 0.1)
    args = [t.to(DEVICE) for t in (x, seeds, pos, greedy, temperature, sampler.token_hash(vocab, torch.device("cpu")))]
    got = fused.race(*args)
    assert torch.equal(got, sampler.race(*args)) and got[0] == 0 and (got[1:] % 7 != 0).all()


def test_a_pointwise_kernel_that_raises_leaves_the_pytorch_forms_serving(monkeypatch, caplog):
    monkeypatch.setattr(triton_decode, "_failed", [])
    monkeypatch.setattr(fused, "_swiglu_kernel", None)  # (its launch raises: None is not subscriptable)
    gate_up = _randn(3, 64, g=torch.Generator().manual_seed(5), scale=5.0)
    torch.testing.assert_close(fused.swiglu_oai(gate_up, 1.702, 7.0), layers.swiglu_oai(gate_up, 1.702, 7.0))
    assert "swiglu_oai" in caplog.text and triton_decode._failed and not triton_decode.serves(torch.device("cuda"))


@pytest.mark.parametrize("failing", ["norm_rope", "experts", "select"])
def test_a_failed_launch_of_the_fused_kernels_leaves_their_pytorch_forms_doing_all_of_it(monkeypatch, caplog, failing):
    """The norm+RoPE kernel with a layer's buffers (K and V still written), the expert pairs with the shared expert
    (still added), the block kernel choosing its blocks (still chosen): each op's fallback takes its whole arguments."""
    monkeypatch.setattr(triton_decode, "_failed", [])
    g = torch.Generator().manual_seed(9)
    if failing == "norm_rope":
        monkeypatch.setattr(fused, "_norm_rope_kernel", None)  # (its launch raises: None is not subscriptable)
        y, w1, w2, v = _randn(3, 10 * 32, g=g), _randn(32, g=g), _randn(32, g=g), _randn(3, 2, 32, g=g)
        rot = layers.rope_rotation(torch.tensor([4, 70, 900], device=DEVICE), layers.rope_inv_freq(16, 1e6).to(DEVICE),
                                   torch.float32)
        got, want = ([torch.zeros(6, 2, 32, device=DEVICE) for _ in "kv"] for _ in "gw")
        loc = torch.tensor([5, 1, 3], device=DEVICE)
        torch.testing.assert_close(fused.norm_rope(y, w1, w2, 8, rot, 1e-6, *got, loc, v),
                                   layers.norm_rope(y, w1, w2, 8, rot, 1e-6, *want, loc, v))
        assert all(torch.equal(a, b) for a, b in zip(got, want)) and got[1][5].abs().sum() > 0
    elif failing == "experts":
        monkeypatch.setattr(fused, "_experts_up_kernel", None)
        x, w13, w2, s13, s2 = (_randn(*s, g=g, scale=0.3) for s in ((3, 64), (4, 192, 64), (4, 64, 96), (64, 64),
                                                                    (64, 32)))
        ids, w = torch.tensor([[0, 2], [1, 3], [2, 0]], device=DEVICE), torch.rand(3, 2, generator=g).to(DEVICE)
        want = layers.gathered_experts(x, ids, w, w13, w2, 1.702, 7.0) + layers.swiglu_oai(x @ s13.T, 1.702, 7.0) @ s2.T
        torch.testing.assert_close(fused.gathered_experts(x, ids, w, w13, w2, 1.702, 7.0, s13, s2), want)
    else:
        monkeypatch.setattr(triton_decode, "_block_kernel", None)
        q, (k, v), scores = _randn(2, 2, 2, 32, g=g), (_randn(900, 2, 32, g=g) for _ in "kv"), _randn(2, 2, 12, g=g)
        key_slots, q_pos = torch.randint(0, 900, (2, 768), generator=g).to(DEVICE), torch.tensor([700, 300], device=DEVICE)
        blocks = select_blocks(scores[:, :, None], block_masks(q_pos[:, None], 12, 64, 4, 1, 1))[:, :, 0]
        torch.testing.assert_close(triton_indexer._select_attend(q, k, v, key_slots, scores, q_pos, 64, 4, 1, 1, 0.2),
                                   triton_decode.paged_block_attention(q, k, v, key_slots, blocks, q_pos, 64, 0.2))
    assert "failed" in caplog.text and triton_decode._failed and not triton_decode.serves(torch.device("cuda"))


def test_an_engine_draws_through_the_race_kernel_at_any_filters(monkeypatch):
    """The engine's sampling reaches the kernel (grad mode and all: it once did not), with top-p or without: a draw is
    one form whatever its batch-mates ask, and a seeded request's tokens are those it gets alone."""
    calls = []
    monkeypatch.setattr(sampler, "fused", SimpleNamespace(serves=lambda x: not torch.is_grad_enabled(),
                                                          race=lambda *a: calls.append(1) or fused.race(*a)))
    got = {}
    for mates in ([], [{"top_p": 0.5}], [{"temperature": 0}]):
        engine = make_engine(max_running_requests=4)
        rid = submit(engine, list(range(30, 60)), max_new_tokens=4, temperature=0.8, sampling_seed=3)[0]
        for extra in mates:
            submit(engine, list(range(70, 90)), max_new_tokens=4, **{"temperature": 0.8, **extra})
        got[len(got)] = run_all(engine)[rid].output_ids
    assert calls and got[0] == got[1] == got[2] and len(got[0]) == 4
