"""The C decode-attention kernel (engine/kernels/paged_attention.c) and the gather + SDPA path beside a
float64 softmax written out over the gathered keys."""

from __future__ import annotations

import pytest
import torch

from engine.kernels.paged_attention import gather_sdpa, in_place, kernel


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


def test_the_kernel_builds_here():
    assert kernel() is not None  # (gcc is on every machine this runs on: inductor needs it too)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("path", ["kernel", "gather_sdpa"])
def test_paged_attention_matches_a_written_out_softmax(shape, path):
    args = case(*shape, seed=sum(shape))
    got = in_place(kernel(), *args) if path == "kernel" else gather_sdpa(*args)
    torch.testing.assert_close(got, reference(*args), rtol=1e-5, atol=1e-5)


def test_the_kernel_gives_zeros_to_a_query_with_no_kept_key():
    q, k_buf, v_buf, rows, keep, scale = case(2, 2, 4, 32, 100, 2, seed=1)
    keep[1, 0] = False
    got = in_place(kernel(), q, k_buf, v_buf, rows, keep, scale)
    assert torch.equal(got[1, 0], torch.zeros_like(got[1, 0]))
    torch.testing.assert_close(got[0], reference(q, k_buf, v_buf, rows, keep, scale)[0], rtol=1e-5, atol=1e-5)
