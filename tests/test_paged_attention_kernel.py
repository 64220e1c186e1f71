"""The C decode-attention kernel (engine/kernels/paged_attention.c) and the gather + SDPA path beside a
float64 softmax written out over the gathered keys."""

from __future__ import annotations

import pytest
import torch

from engine.kernels import build, build_all, paged_attention
from engine.kernels.paged_attention import block_rows, gather_sdpa, in_place, kernel, paged_block_attention
from tests.kernel_utils import needs_compiler, without_compiler


def reference(q, k_buf, v_buf, rows, keep, scale):
    d = q.shape[-1]
    k = k_buf.view(-1, d).double()[rows]  # [B, H, N, D]
    v = v_buf.view(-1, d).double()[rows]
    s = (q.double() @ k.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))  # [B, H, G, N]
    return (torch.softmax(s, dim=-1) @ v).float()


def case(batch, heads, group, dim, keys, keep_heads, seed, slots=500):
    g = torch.Generator().manual_seed(seed)
    k_buf, v_buf = torch.randn(slots, heads, dim, generator=g), torch.randn(slots, heads, dim, generator=g)
    slot = torch.randint(0, slots, (batch, keys), generator=g)
    rows = slot[:, None, :] * heads + torch.arange(heads)[None, :, None]
    keep = torch.rand(batch, keep_heads, 1, keys, generator=g) < 0.6
    keep[..., 0] = True  # (every query keeps a key, as in the engine: its own)
    q = 3 * torch.randn(batch, heads, group, dim, generator=g)  # (sharp softmaxes: the running max matters)
    return q, k_buf, v_buf, rows, keep, dim ** -0.5


SHAPES = [(1, 2, 4, 32, 320, 1), (3, 2, 4, 32, 200, 2), (5, 1, 2, 32, 64, 1), (2, 2, 4, 16, 1000, 1),
          (4, 3, 1, 24, 7, 3)]


@needs_compiler
def test_the_kernel_builds_here():
    assert kernel() is not None  # (with a compiler at hand, a kernel that does not build is a failure)


@pytest.mark.usefixtures("two_threads")  # (the kernels split rows between threads)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("path", [pytest.param("kernel", marks=needs_compiler), "gather_sdpa"])
def test_paged_attention_matches_a_written_out_softmax(shape, path):
    args = case(*shape, seed=sum(shape))
    got = in_place(kernel().paged_decode_attention, *args) if path == "kernel" else gather_sdpa(*args)
    torch.testing.assert_close(got, reference(*args), rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.usefixtures("two_threads")  # (the kernels split rows between threads)
@pytest.mark.parametrize("lanes", [8, 16])
def test_both_vector_widths_match_a_written_out_softmax(lanes):
    """The kernel as built for AVX2 (8 lanes) and for AVX-512 (16 lanes), whichever this CPU has: head
    sizes that take the vector accumulators at one width, or both, or neither."""
    lib = paged_attention.bind(build.load(paged_attention.SOURCE, (f"-DLANES={lanes}",)))
    for shape in SHAPES + [(2, 2, 4, 64, 90, 1), (2, 1, 2, 128, 70, 1)]:
        args = case(*shape, seed=sum(shape))
        torch.testing.assert_close(in_place(lib.paged_decode_attention, *args), reference(*args), rtol=1e-5, atol=1e-5)


@needs_compiler
def test_the_kernel_gives_zeros_to_a_query_with_no_kept_key():
    q, k_buf, v_buf, rows, keep, scale = case(2, 2, 4, 32, 100, 2, seed=1)
    keep[1, 0] = False
    got = in_place(kernel().paged_decode_attention, q, k_buf, v_buf, rows, keep, scale)
    assert torch.equal(got[1, 0], torch.zeros_like(got[1, 0]))
    torch.testing.assert_close(got[0], reference(q, k_buf, v_buf, rows, keep, scale)[0], rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.usefixtures("two_threads")  # (the kernels split rows between threads)
@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("rows,heads,group,dim,topk,block,keys,shared", [
    (5, 2, 4, 32, 4, 16, 200, False), (7, 2, 3, 24, 3, 8, 90, True), (1, 1, 2, 32, 4, 64, 320, False),
    (4, 2, 4, 32, 3, 48, 300, False), (3, 2, 2, 32, 2, 128, 400, False)])  # (blocks across the kernel's 64-key tiles)
def test_block_attention_matches_the_same_keys_listed(rows, heads, group, dim, topk, block, keys, shared, lanes,
                                                       monkeypatch):
    """paged_block_attention (the C kernel walks the selected blocks, built at both vector widths) against
    paged attention over the rows and mask `block_rows` lists for the same blocks, and that against the float64
    softmax."""
    lib = paged_attention.bind(build.load(paged_attention.SOURCE, (f"-DLANES={lanes}",)))
    monkeypatch.setattr(paged_attention, "kernel", lambda: lib)
    g = torch.Generator().manual_seed(rows)
    k_buf, v_buf = torch.randn(500, heads, dim, generator=g), torch.randn(500, heads, dim, generator=g)
    q = torch.randn(rows, heads, group, dim, generator=g)
    key_slots = torch.randint(0, 500, (1 if shared else rows, keys), generator=g).expand(rows, -1)
    q_pos = torch.randint(block, keys, (rows,), generator=g)
    blocks = torch.stack([torch.stack([torch.randperm(keys // block, generator=g)[:topk] for _ in range(heads)])
                          for _ in range(rows)])
    blocks[..., -1] = torch.div(q_pos, block, rounding_mode="floor")[:, None]  # (the query's own block)
    blocks[0, 0, 0] = -1  # an unused slot
    got = paged_block_attention(q, k_buf, v_buf, key_slots, blocks, q_pos, block, dim ** -0.5)
    listed, keep = block_rows(key_slots, blocks, q_pos, block)
    want = reference(q, k_buf, v_buf, listed, keep[:, :, None], dim ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gather_sdpa(q, k_buf, v_buf, listed, keep[:, :, None], dim ** -0.5), want,
                               rtol=1e-5, atol=1e-5)


@needs_compiler
def test_loading_the_kernel_leaves_subnormal_floats_alone():
    """The library must not switch the process to flush-to-zero (gcc's crtfastmath.o does, if linked)."""
    assert kernel() is not None
    tiny = torch.tensor([1e-40], dtype=torch.float32)  # a float32 subnormal
    assert (tiny * 1.0).item() != 0.0 and (tiny + tiny).item() > tiny.item()


def test_without_a_compiler_the_ops_warn_and_gather_instead(monkeypatch, tmp_path, caplog):
    """No compiler: building every kernel warns, naming each kernel and what runs instead (nothing raises), and
    both ops, through their gather + SDPA path, still match the written-out softmax."""
    without_compiler(monkeypatch, tmp_path)
    with caplog.at_level("WARNING"):
        build_all()
    for name, instead in (("paged_attention.c", "gathering and calling SDPA instead"),
                          ("moe_experts.c", "MoE layers keep their PyTorch forms")):
        assert f"{name}: the C kernel is unavailable" in caplog.text and instead in caplog.text
    assert paged_attention.kernel() is None and not list(tmp_path.rglob("*.so"))
    args = case(3, 2, 4, 32, 200, 2, seed=3)
    torch.testing.assert_close(torch.ops.minimax.paged_attention(*args), reference(*args), rtol=1e-5, atol=1e-5)
    q, k_buf, v_buf, rows, keep, scale = args
    key_slots, q_pos = torch.arange(200).expand(3, -1), torch.tensor([199, 70, 130])
    blocks = torch.tensor([[0, 2, 3], [0, 1, -1], [3, 1, 2]])[:, None, :].expand(3, 2, 3)
    pos = torch.arange(200)  # (key j at slot j: the keys of the selected blocks of 50, up to q_pos)
    kept = (pos // 50 == blocks[..., None]).any(-2) & (pos <= q_pos[:, None, None])  # [3, 2, 200]
    want = reference(q, k_buf, v_buf, (pos * 2 + torch.arange(2)[:, None]).expand(3, 2, 200), kept[:, :, None], scale)
    got = torch.ops.minimax.paged_block_attention(q, k_buf, v_buf, key_slots, blocks, q_pos, 50, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
