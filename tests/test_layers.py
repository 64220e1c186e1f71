"""Layer building blocks against their elementwise definitions (model.md §2)."""

from __future__ import annotations

import pytest
import torch

from engine.layers import Rotary, apply_rope, rope_inv_freq


@pytest.mark.parametrize("dim,rot", [(32, 16), (16, 16), (24, 8)])
def test_rotation_matrix_rope_equals_elementwise(dim, rot):
    g = torch.Generator().manual_seed(dim)
    pos = torch.randint(0, 5000, (7,), generator=g)
    rope = Rotary(pos, rope_inv_freq(rot, 10000.0), torch.float32)
    assert rope.use_matrix
    x = torch.randn(7, 5, dim, generator=g)
    want = apply_rope(x, rope.cos, rope.sin)
    assert (rope(x) - want).abs().max().item() < 1e-5
    u, w = x[..., : rot // 2], x[..., rot // 2: rot]  # the spec's halves form, written out
    c, s = rope.cos[:, None], rope.sin[:, None]
    spec = torch.cat([u * c - w * s, w * c + u * s, x[..., rot:]], dim=-1)
    assert (want - spec).abs().max().item() < 1e-6
