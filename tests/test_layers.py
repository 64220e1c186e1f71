"""Layer building blocks against their elementwise definitions (model.md §2)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from engine.kernels import build, moe_experts
from engine.kernels.moe_experts import on_kernel
from engine.model.config_json import load_config
from engine.model.layers import (
    MoE,
    apply_rope,
    gathered_experts,
    norm_rope,
    rms_norm,
    rope_inv_freq,
    rope_rotation,
)
from tests.engine_utils import TINY
from tests.kernel_utils import needs_compiler, without_compiler


@pytest.mark.parametrize("dim,rot", [(32, 16), (16, 16), (24, 8)])
def test_rope_equals_the_spec_written_per_channel_pair(dim, rot):
    g = torch.Generator().manual_seed(dim)
    pos = torch.randint(0, 5000, (7,), generator=g)
    inv = rope_inv_freq(rot, 10000.0)
    assert torch.allclose(inv.double(), 10000.0 ** (-torch.arange(0, rot, 2).double() / rot), rtol=1e-6)
    x = torch.randn(7, 5, dim, generator=g, dtype=torch.float64)
    got = apply_rope(x, rope_rotation(pos, inv, torch.float64))
    for t in range(7):
        for i in range(rot // 2):  # model.md §2: u' = u cos a - w sin a, w' = w cos a + u sin a
            a = float(pos[t].float() * inv[i])  # the angle in fp32, as the model computes it
            u, w = x[t, :, i], x[t, :, rot // 2 + i]
            assert torch.allclose(got[t, :, i], u * math.cos(a) - w * math.sin(a), atol=1e-5)
            assert torch.allclose(got[t, :, rot // 2 + i], w * math.cos(a) + u * math.sin(a), atol=1e-5)
    assert torch.equal(got[..., rot:], x[..., rot:])


def test_gemma_rms_norm():
    """Against the definition in float64; the norm computes in fp32 whatever the input (model.md §2), so to fp32's
    precision (atol 1e-12 with allclose's rtol failed wherever an output fell near 0: the draw was unseeded)."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(3, 16, dtype=torch.float64, generator=g), torch.randn(16, dtype=torch.float64, generator=g)
    want = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + w)
    assert torch.allclose(rms_norm(x, w, 1e-6), want, rtol=0, atol=2e-6)
    heads, w2 = torch.randn(3, 4, 16, dtype=torch.float64), torch.randn(4, 16, dtype=torch.float64)  # one per head
    assert torch.equal(rms_norm(heads, w2, 1e-6), torch.stack([rms_norm(heads[:, h], w2[h], 1e-6) for h in range(4)], 1))


def test_norm_rope_of_parts_at_once_equals_each_part_alone():
    g = torch.Generator().manual_seed(0)
    inv, pos = rope_inv_freq(8, 10000.0), torch.randint(0, 5000, (5,), generator=g)
    rot = rope_rotation(pos, inv, torch.float32)
    y, wq, wk = (torch.randn(*s, generator=g) for s in ((5, 6 * 16), (16,), (16,)))
    q, k = norm_rope(y, wq, wk, 4, rot, 1e-6).tensor_split([4], 1)
    assert torch.equal(q, apply_rope(rms_norm(y[:, :64].view(5, 4, 16), wq, 1e-6), rot))
    assert torch.equal(k, apply_rope(rms_norm(y[:, 64:].view(5, 2, 16), wk, 1e-6), rot))


def _moe(top_k: int, seed: int) -> MoE:
    cfg = dataclasses.replace(load_config(TINY), num_experts_per_tok=top_k)
    moe = MoE(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / (p.shape[-1] ** 0.5 if p.dim() > 1 else 1.0))
    return moe


def _moe_reference(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """model.md §2.5 written out per token in float64: sigmoid scores, top-k on score + bias,
    weights renormalized, gamma-scaled sum of the chosen SwiGLU-OAI experts, plus the shared expert."""
    x = x.double()
    out = torch.zeros_like(x)

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


@needs_compiler
@pytest.mark.usefixtures("two_threads")  # (the kernels split rows between threads)
@pytest.mark.parametrize("forced", [None, [0, 2, 4], [0, 1, 5], [7, 3, 1]])
def test_moe_forms_match_reference(forced):
    """Every form of the routed experts against float64: the C kernel (what MoE runs on CPU float32, eager
    and in the batched graphs), tokens grouped by expert in PyTorch (eager elsewhere), and both static forms
    of the compiled graphs (one token through its gathered experts, several through every expert). 40 tokens
    steered to 3 experts give each expert more pairs than one of the kernel's work items holds."""
    moe = _moe(top_k=3, seed=len(forced or []))
    if forced is not None:  # steer every token to these experts
        with torch.no_grad():
            moe.router_bias.zero_()
            moe.router_bias[forced] = 100.0
    g = torch.Generator().manual_seed(1)
    assert on_kernel(torch.empty(1), moe.w13, moe.w2)  # (so moe(x) below is the kernel)
    with torch.inference_mode():
        for tokens in (1, 16, 40):
            x = torch.randn(tokens, 256, generator=g)
            want = _moe_reference(moe, x)
            ids, w = moe.route(x)
            shared = moe.shared(x)
            for got in (moe(x), moe._grouped(x, ids, w) * moe.scale + shared,
                        gathered_experts(x, ids, w, moe.w13, moe.w2, moe.alpha, moe.limit) * moe.scale + shared):
                assert (got.double() - want).abs().max().item() < 1e-4


@needs_compiler
@pytest.mark.usefixtures("two_threads")  # (the kernels split rows between threads)
@pytest.mark.parametrize("lanes", [8, 16])
def test_the_moe_kernel_at_both_vector_widths_matches_reference(lanes):
    """moe_experts.c as built for AVX2 (8 lanes, 8 weight rows a pass) and for AVX-512 (16), whichever this
    CPU has, against float64 (its lane sums are written per width)."""
    lib = moe_experts.bind(build.load(moe_experts.SOURCE, (f"-DLANES={lanes}",)))
    moe = _moe(top_k=2, seed=lanes)
    g = torch.Generator().manual_seed(lanes)
    with torch.inference_mode():
        for tokens in (1, 40):
            x = torch.randn(tokens, 256, generator=g)
            ids, w = moe.route(x)
            got = moe_experts.run(lib, x, ids, w, moe.w13, moe.w2, moe.alpha, moe.limit) * moe.scale + moe.shared(x)
            assert (got.double() - _moe_reference(moe, x)).abs().max().item() < 1e-4


def test_without_a_compiler_moe_warns_and_keeps_its_pytorch_forms(monkeypatch, tmp_path, caplog):
    """No compiler: the kernel's absence is a warning naming it and what runs instead, MoE takes its PyTorch
    forms and still matches float64, and the op itself, called anyway, refuses with a clear error."""
    without_compiler(monkeypatch, tmp_path)
    moe, g = _moe(top_k=2, seed=3), torch.Generator().manual_seed(3)
    with caplog.at_level("WARNING"):
        assert not on_kernel(torch.empty(1), moe.w13, moe.w2)
    assert "moe_experts.c: the C kernel is unavailable" in caplog.text
    assert "MoE layers keep their PyTorch forms" in caplog.text
    with torch.inference_mode():
        for tokens in (1, 16):
            x = torch.randn(tokens, 256, generator=g)
            assert (moe(x).double() - _moe_reference(moe, x)).abs().max().item() < 1e-4
        ids, w = moe.route(x)
        with pytest.raises(ValueError, match="with the C kernel built"):
            torch.ops.minimax.moe_experts(x, ids, w, moe.w13, moe.w2, moe.alpha, moe.limit)
