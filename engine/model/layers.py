"""Building blocks of the decoder (model.md §2): Gemma RMSNorm, partial NeoX RoPE, SwiGLU-OAI MLP, MoE.

Parameters are stored in the fused layout the forward pass wants (gate|up fused, experts as 3-D
tensors); `engine/loader.py` converts both checkpoint layouts into it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.config import ModelConfig
from engine.model.linear import linear


def as_dtype(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, without a dispatch when it already is (decode runs hundreds of these per step)."""
    return x if x.dtype == dtype else x.to(dtype)


class GemmaRMSNorm(nn.Module):
    """x / sqrt(mean(x^2) + eps) * (1 + w), in fp32, cast back to the input dtype at the end."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))
        self.finalize()

    def finalize(self) -> None:
        """(1 + w) in fp32, derived from the loaded weight (a plain attribute: not in state_dict)."""
        self.scale = [1.0 + self.weight.detach().float()]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return as_dtype(F.rms_norm(as_dtype(x, torch.float32), self.weight.shape, self.scale[0], self.eps), x.dtype)


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


# NOTE: up to this many tokens per step, RoPE is one batched matmul with a per-token rotation matrix
# (decode: one kernel instead of a dozen); above it, the elementwise form (no [T, D, D] tables).
ROT_MATRIX_MAX_TOKENS = 64


class Rotary:
    """RoPE for one step's positions, computed once and applied by every layer to q, k, index q/k."""

    def __init__(self, positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> None:
        self.cos, self.sin = rope_cos_sin(positions, inv_freq, dtype)
        self.use_matrix = positions.shape[0] <= ROT_MATRIX_MAX_TOKENS
        self._mats: dict[int, torch.Tensor] = {}

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, dim] (first r channels, NeoX halves; the rest pass through)."""
        if not self.use_matrix:
            return apply_rope(x, self.cos, self.sin)
        d = x.shape[-1]
        if d not in self._mats:
            self._mats[d] = self._matrix(d)
        return torch.matmul(x, self._mats[d])

    def _matrix(self, d: int) -> torch.Tensor:
        """M[t] with (x @ M[t]) == apply_rope(x) for token t: cos on the diagonal, +-sin across halves."""
        t, half = self.cos.shape
        m = torch.zeros(t, d, d, dtype=self.cos.dtype, device=self.cos.device)
        i = torch.arange(half, device=m.device)
        m[:, i, i] = self.cos
        m[:, i + half, i + half] = self.cos
        m[:, i + half, i] = -self.sin
        m[:, i, i + half] = self.sin
        rest = torch.arange(2 * half, d, device=m.device)
        m[:, rest, rest] = 1
        return m


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """act = min(g, lim) * sigmoid(alpha * min(g, lim)) * (clamp(u, -lim, lim) + 1), gate half first."""
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    act = torch.sigmoid(gate * alpha).mul_(gate)  # in place where the tensor is fresh: fewer allocations
    return up.clamp(min=-limit, max=limit).add_(1.0).mul_(act)


class GatedMLP(nn.Module):
    """Dense SwiGLU-OAI MLP with a fused [gate | up] projection."""

    threads = 1  # CPU threads a few-row matmul is split over (`engine.linear`); set by the model

    def __init__(self, hidden: int, inter: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(hidden, inter))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """MLP(x), plus `residual` when given (fused into the down projection)."""
        act = swiglu_oai(linear(x, self.gate_up_proj, threads=self.threads), self.alpha, self.limit)
        return linear(act, self.down_proj, residual, threads=self.threads)


class MoE(nn.Module):
    """Sigmoid-routed experts with correction bias, routed scaling and an always-on shared expert."""

    threads = 1  # as GatedMLP.threads

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
        scores = torch.sigmoid(F.linear(as_dtype(x, torch.float32), self.router))
        _, ids = torch.topk(scores + self.router_bias, self.top_k, dim=-1, sorted=False)
        w = scores.gather(1, ids)
        return ids, w / w.sum(dim=-1, keepdim=True)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """MoE(x), plus `residual` when given."""
        ids, w = self.route(x)
        base = residual if residual is not None else torch.zeros_like(x)
        if self.shared is not None:
            base = self.shared(x, residual=base)
        if x.shape[0] * self.top_k <= self.w13.shape[0]:
            return self._per_token(x, ids, w, base)
        return torch.add(base, self._grouped(x, ids, w), alpha=self.scale)

    def _per_token(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """Few tokens (decode): each token runs its k experts as one batched matmul pair over a strided
        view of the expert weights (nothing gathered; the sorted ids must be evenly spaced, always
        true for k <= 2), and one matmul adds their outputs, weighted by gamma * weight, to `base`."""
        rows = []
        for t, (experts, weights) in enumerate(zip(ids.tolist(), w.tolist())):
            pairs = sorted(zip(experts, weights))
            sel = _even_slice([e for e, _ in pairs])
            if sel is None:  # unevenly spaced experts: one at a time
                acc = base[t:t + 1]
                for e, wt in pairs:
                    h = swiglu_oai(linear(x[t:t + 1], self.w13[e], threads=self.threads), self.alpha, self.limit)
                    acc = linear(h, self.w2[e], acc, alpha=wt * self.scale, threads=self.threads)
                rows.append(acc)
                continue
            k = len(pairs)
            h = swiglu_oai(torch.bmm(x[t:t + 1].expand(k, 1, -1), self.w13[sel].mT), self.alpha, self.limit)
            y = torch.bmm(h, self.w2[sel].mT).view(k, -1)  # [k, H]
            gates = torch.tensor([[wt for _, wt in pairs]], dtype=x.dtype, device=x.device)
            rows.append(torch.addmm(base[t:t + 1], gates, y, alpha=self.scale))
        return rows[0] if len(rows) == 1 else torch.cat(rows)

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """Many tokens: one matmul pair per expert over the (token, slot) pairs routed to it."""
        t, k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
        counts = torch.bincount(flat, minlength=self.w13.shape[0]).tolist()
        xs = x.index_select(0, order // k)
        ys, start = [], 0
        for e, n in enumerate(counts):
            if n:
                h = swiglu_oai(linear(xs[start:start + n], self.w13[e], threads=self.threads), self.alpha, self.limit)
                ys.append(linear(h, self.w2[e], threads=self.threads))
                start += n
        y = torch.cat(ys) * w.reshape(-1)[order].to(x.dtype)[:, None]
        out = torch.empty_like(y).index_copy_(0, order, y)  # back to (token, slot) order
        return out.view(t, k, -1).sum(dim=1)


def _even_slice(ids: list[int]) -> slice | None:
    """A slice selecting exactly the sorted, distinct `ids` (evenly spaced), else None."""
    if len(ids) == 1:
        return slice(ids[0], ids[0] + 1)
    step = ids[1] - ids[0]
    if step <= 0 or any(b - a != step for a, b in zip(ids, ids[1:])):
        return None
    return slice(ids[0], ids[-1] + 1, step)
