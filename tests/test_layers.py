"""Layer building blocks against their elementwise definitions (model.md §2)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine.model.config import load_config
from engine.model.layers import MoE, Rotary, apply_rope, rope_inv_freq
from engine.model.linear import cpu_layout
from tests.engine_utils import TINY


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


def _moe(top_k: int, seed: int) -> MoE:
    cfg = dataclasses.replace(load_config(TINY), num_experts_per_tok=top_k)
    moe = MoE(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 1.0))
            if p.dim() > 1:
                p.data = cpu_layout(p.data)
    moe.threads = 2
    return moe


def _moe_reference(moe: MoE, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
    """model.md §2.5 written out per token in float64: sigmoid scores, top-k on score + bias,
    weights renormalized, gamma-scaled sum of the chosen SwiGLU-OAI experts, plus the shared expert."""
    x, out = x.double(), residual.double().clone()

    def mlp(v: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        g, u = (v @ gate_up.double().T).chunk(2, dim=-1)
        g, u = g.clamp(max=moe.limit), u.clamp(-moe.limit, moe.limit)
        return ((u + 1) * g * torch.sigmoid(moe.alpha * g)) @ down.double().T

    for t in range(x.shape[0]):
        s = torch.sigmoid(x[t] @ moe.router.double().T)
        ids = torch.topk(s + moe.router_bias.double(), moe.top_k).indices
        w = s[ids] / s[ids].sum()
        out[t] += mlp(x[t], moe.shared.gate_up_proj, moe.shared.down_proj)
        for e, we in zip(ids.tolist(), w.tolist()):
            out[t] += moe.scale * we * mlp(x[t], moe.w13[e], moe.w2[e])
    return out


@pytest.mark.parametrize("forced", [None, [0, 2, 4], [0, 1, 5], [7, 3, 1]])
def test_moe_decode_and_grouped_paths_match_reference(forced):
    """One token (per-token path: evenly spaced experts as one strided batch, others one by one) and
    16 tokens (grouped path) against the float64 reference."""
    moe = _moe(top_k=3, seed=len(forced or []))
    if forced is not None:  # steer every token to these experts
        with torch.no_grad():
            moe.router_bias.zero_()
            moe.router_bias[forced] = 100.0
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for tokens in (1, 16):
            x, res = torch.randn(tokens, 256, generator=g), torch.randn(tokens, 256, generator=g)
            got = moe(x, residual=res)
            assert (got.double() - _moe_reference(moe, x, res)).abs().max().item() < 1e-4
