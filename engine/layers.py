"""Building blocks of the decoder (model.md §2): Gemma RMSNorm, partial NeoX RoPE, SwiGLU-OAI MLP, MoE.

Parameters are stored in the fused layout the forward pass wants (gate|up fused, experts as 3-D
tensors); `engine/loader.py` converts both checkpoint layouts into it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.config import ModelConfig


class GemmaRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * (1 + w), in fp32, cast back to the input dtype at the end."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (out * (1.0 + weight.float())).to(x.dtype)


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """inv_f_i = theta^(-2i/r) for i in [0, r/2), fp32."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, r/2] for absolute positions; computed once per step, shared by every layer."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotation of the first r channels of x [T, heads, dim]; channels r.. pass through."""
    half = cos.shape[-1]
    r = 2 * half
    c, s = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :half], x[..., half:r]
    rotated = (x1 * c - x2 * s, x2 * c + x1 * s)
    if r == x.shape[-1]:
        return torch.cat(rotated, dim=-1)
    return torch.cat((*rotated, x[..., r:]), dim=-1)


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """act = min(g, lim) * sigmoid(alpha * min(g, lim)) * (clamp(u, -lim, lim) + 1), gate half first."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1.0) * (gate * torch.sigmoid(gate * alpha))


class GatedMLP(nn.Module):
    """Dense SwiGLU-OAI MLP with a fused [gate | up] projection."""

    def __init__(self, hidden: int, inter: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(hidden, inter))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(swiglu_oai(F.linear(x, self.gate_up_proj), self.alpha, self.limit), self.down_proj)


class MoE(nn.Module):
    """Sigmoid-routed experts with correction bias, routed scaling and an always-on shared expert."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
        self.top_k, self.scale = cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        # NOTE: the router weight and bias stay fp32 whatever the model dtype (model.md §7.12).
        self.router = nn.Parameter(torch.empty(e, h, dtype=torch.float32))
        self.router_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32))
        self.w13 = nn.Parameter(torch.empty(e, 2 * i, h))
        self.w2 = nn.Parameter(torch.empty(e, h, i))
        self.shared = (GatedMLP(h, cfg.shared_intermediate_size, self.alpha, self.limit)
                       if cfg.shared_intermediate_size > 0 else None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Top-k expert ids [T, k] and their normalized weights [T, k] (fp32)."""
        scores = torch.sigmoid(F.linear(x.float(), self.router))
        _, ids = torch.topk(scores + self.router_bias, self.top_k, dim=-1, sorted=False)
        w = scores.gather(1, ids)
        return ids, w / w.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, w = self.route(x)
        if ids.numel() <= 2 * self.w13.shape[0]:
            routed = self._gathered(x, ids, w)
        else:
            routed = self._grouped(x, ids, w)
        out = routed * self.scale
        return out + self.shared(x) if self.shared is not None else out

    def _gathered(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Few tokens: gather the chosen experts' weights and run one batched matmul (reads only them)."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        xs = x.repeat_interleave(k, dim=0).unsqueeze(-1)  # [T*k, H, 1]
        act = swiglu_oai(torch.bmm(self.w13[flat], xs).squeeze(-1), self.alpha, self.limit)
        y = torch.bmm(self.w2[flat], act.unsqueeze(-1)).squeeze(-1)  # [T*k, H]
        return (y.view(t, k, -1) * w.to(y.dtype).unsqueeze(-1)).sum(dim=1)

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Many tokens: one matmul per expert over the tokens routed to it."""
        out = torch.zeros_like(x)
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        token_of = order // ids.shape[1]
        weight_of = w.reshape(-1)[order].to(x.dtype)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            tok = token_of[start:start + n]
            h = swiglu_oai(F.linear(x[tok], self.w13[e]), self.alpha, self.limit)
            out.index_add_(0, tok, F.linear(h, self.w2[e]) * weight_of[start:start + n, None])
            start += n
        return out
