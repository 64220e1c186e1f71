"""The decoder's building blocks (model.md §2): Gemma RMSNorm, partial NeoX RoPE, SwiGLU-OAI MLP, MoE. Parameters are in
the forward pass's fused layout (gate|up fused, experts as 3-D tensors); loader.py converts both checkpoint layouts. On
CUDA, where `fused.serves`, Triton kernels (triton_pointwise.py) run the PyTorch forms here in one kernel each."""

import functools

import torch
import torch.nn.functional as F
from torch import nn

from engine.kernels import triton_pointwise as fused
from engine.kernels.moe_experts import moe_experts, on_kernel
from engine.model.config import ModelConfig


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * (1 + w) in fp32, cast back; w [D] or [heads, D].
    NOTE: `F.rms_norm` is one kernel on CUDA (written out, seven); n * (1 + w) as n + n * w, one; in bf16 it writes the
    cast back (out=; in fp32 out= slows the CPU's compiled step 19.1 -> 21.5 ms at 64 rows)."""
    if fused.serves(x) and weight.dim() == 1:
        return fused.rms_norm(x, weight, eps)
    n = F.rms_norm(x.float(), x.shape[-1:], eps=eps)
    if x.dtype == n.dtype or torch.is_grad_enabled():  # (nothing to cast; or training: out= has no autograd)
        return torch.addcmul(n, n, weight.float()).to(x.dtype)
    return torch.addcmul(n, n, weight.float(), out=torch.empty_like(x))


def norm_rope(y: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, first: int, rot: torch.Tensor, eps: float,
              k_buf: torch.Tensor | None = None, v_buf: torch.Tensor | None = None, loc: torch.Tensor | None = None,
              v: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head norm, then RoPE (model.md §2, §3.1), of y [T, heads * d] -> [T, heads, d]: heads < first normed by w1
    [d], the rest (the keys) by w2. With k_buf, the keys are also written to its rows loc, and v [T, ...] to v_buf's.
    NOTE: q with k (index q with k) at once: a third of the kernels of one at a time; on CUDA the writes too (SGLang
    fuses the K/V store into its rotary kernel the same way)."""
    d = w1.shape[0]
    if fused.serves(y, d):
        return fused.norm_rope(y, w1, w2, first, rot, eps, k_buf, v_buf, loc, v)
    w = torch.cat([w1.expand(first, d), w2.expand(y.shape[1] // d - first, d)])  # [heads, d]: each head's weight
    out = apply_rope(rms_norm(y.view(y.shape[0], w.shape[0], d), w, eps), rot)  # (no -1: a batch may be empty)
    for buf, rows in ((k_buf, out[:, first:]), (v_buf, v)):  # (the keys, and the values where given)
        if buf is not None:
            buf.index_copy_(0, loc, rows)
    return out


def add_rms_norm(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                 dtype: torch.dtype | None = None) -> tuple:
    """(h, rms_norm(h)) for h = x + delta: a residual add and the norm after it, one kernel on CUDA; the norm's values
    (rounded to x's dtype) held in `dtype` where given."""
    if fused.serves(x):
        return fused.add_rms_norm(x, delta, weight, eps, dtype)
    h = x + delta
    return h, rms_norm(h, weight, eps).to(dtype or x.dtype)


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.zeros(dim))  # (the weight stored offset from 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def add(self, x: torch.Tensor, delta: torch.Tensor | None, dtype: torch.dtype | None = None) -> tuple:
        """(x + delta, its norm, in `dtype` where given); where delta is None (the first layer's), (x, its norm)."""
        return (x, self(x)) if delta is None else add_rms_norm(x, delta, self.weight, self.eps, dtype)


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """inv_f_i = theta^(-2i/r) for i in [0, r/2), fp32."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))


def rope_rotation(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[[cos, -sin], [sin, cos]] for each channel pair at the positions, [T, 2, 2, r/2]: once a step, all layers."""
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = angles.cos(), angles.sin()
    return torch.stack((cos, -sin, sin, cos), dim=1).unflatten(1, (2, 2)).to(dtype)


def apply_rope(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """Partial NeoX RoPE on x [T, heads, dim]: the first r channels as halves u, w become
    (u cos - w sin, w cos + u sin), each pair (u_i, w_i) rotated by rot [T, 2, 2, r/2]; channels r.. pass through."""
    r = 2 * rot.shape[-1]
    pairs = x[..., :r].unflatten(-1, (1, 2, -1))  # [T, heads, 1, 2, r/2]: (u; w)
    return torch.cat(((rot[:, None] * pairs).sum(dim=-2).flatten(-2), x[..., r:]), dim=-1)


def swiglu_oai(gate_up: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """g = min(gate, lim), u = clamp(up, -lim, lim): g * sigmoid(alpha * g) * (u + 1), gate half first."""
    if fused.serves(gate_up):
        return fused.swiglu_oai(gate_up, alpha, limit)
    gate, up = gate_up.chunk(2, dim=-1)
    gate = gate.clamp(max=limit)
    act = gate * torch.sigmoid(alpha * gate)
    return torch.addcmul(act, act, up.clamp(min=-limit, max=limit))  # (act * (u + 1) as act + act * u: one kernel)


class GatedMLP(nn.Module):
    """Dense SwiGLU-OAI MLP with a fused [gate | up] projection."""

    input_dtype: torch.dtype | None = None  # (the model's)

    def __init__(self, hidden: int, inter: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.alpha, self.limit = alpha, limit
        self.gate_up_proj = nn.Parameter(torch.empty(2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(hidden, inter))

    def forward(self, x: torch.Tensor, plus: torch.Tensor | None = None) -> torch.Tensor:
        """The MLP of x; with `plus`, plus + it, written into `plus` (the down projection adds it: one kernel)."""
        h = swiglu_oai(F.linear(x, self.gate_up_proj), self.alpha, self.limit)
        return F.linear(h, self.down_proj) if plus is None else plus.addmm_(h, self.down_proj.t())


GATHER_ROWS = 16
PAIR_BYTES = 64 << 20  # CUDA: Triton's pair kernels unless they read this much more than the grouped form (a guess)


@functools.cache  # (a constant to the compiler: precompiled.py says so)
def hopper_or_later(device: torch.device) -> bool:
    return torch.cuda.get_device_capability(device)[0] in (9, 10)


def grouped_kernel(x: torch.Tensor) -> bool:
    """Whether torch's grouped matmul takes x without reading its group sizes on the host: on CPU (no sync to
    make), and in bfloat16 on Hopper/Blackwell GPUs (its grouped kernel; elsewhere a loop over the groups)."""
    return x.device.type == "cpu" or (x.dtype == torch.bfloat16 and hopper_or_later(x.device))


def gathered_experts(x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                     alpha: float, limit: float, s13: torch.Tensor | None = None, s2: torch.Tensor | None = None
                     ) -> torch.Tensor:
    """sum_s w[t, s] * W2_e swiglu_oai(W13_e x[t]) with e = ids[t, s] (`moe_experts`'s math); with s13, s2, plus the
    shared expert's. NOTE: as multiply-and-sum, inductor reads the k experts' rows in place (one kernel, no gathered
    copy): 85 vs 126 us a layer for an einsum."""
    x = x.to(w13.dtype)  # (the Triton form's signature: its x may be in the router's dtype; the shared expert a pair)
    if s13 is not None:
        return gathered_experts(x, ids, w, w13, w2, alpha, limit) + F.linear(swiglu_oai(x @ s13.T, alpha, limit), s2)
    if x.shape[0] > GATHER_ROWS:  # (in pieces: the gathered weights are k expert copies a token)
        return torch.cat([gathered_experts(x[i:i + GATHER_ROWS], ids[i:i + GATHER_ROWS], w[i:i + GATHER_ROWS], w13, w2,
                                           alpha, limit) for i in range(0, x.shape[0], GATHER_ROWS)])
    h = swiglu_oai((x[:, None, None, :] * w13[ids]).sum(dim=-1), alpha, limit)  # [T, k, I]
    y = (h[:, :, None, :] * w2[ids]).sum(dim=-1)  # [T, k, H]
    return (y * w.to(y.dtype)[..., None]).sum(dim=1)


def route(logits: torch.Tensor, bias: torch.Tensor, top_k: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k expert ids [T, k] (chosen on score + bias, score = sigmoid(logit)), their normalized scores [T, k] * scale."""
    if fused.serves(logits):
        return fused.route(logits, bias, top_k, scale)
    scores = torch.sigmoid(logits)
    ids = torch.topk(scores + bias, top_k, dim=-1).indices
    w = scores.gather(1, ids)
    return ids, w / (w.sum(dim=-1, keepdim=True) / scale)


class MoE(nn.Module):
    """Sigmoid-routed experts with correction bias, routed scaling and an always-on shared expert:
    FFN(x) = gamma * sum_{e in E} w_e Expert_e(x) + Shared(x) (model.md §2)."""

    input_dtype = torch.float32  # (the router's; the norm before it writes its values so: a cast kernel less)

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i, e = cfg.hidden_size, cfg.intermediate_size, cfg.num_experts
        self.top_k, self.scale = cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.alpha, self.limit = cfg.swiglu_alpha, cfg.swiglu_limit
        # NOTE: the router weight and bias stay fp32 whatever the model dtype (model.md §7.12).
        self.router = nn.Parameter(torch.empty(e, h, dtype=torch.float32))
        self.router_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32))
        self.w13, self.w2 = nn.Parameter(torch.empty(e, 2 * i, h)), nn.Parameter(torch.empty(e, h, i))
        self.shared = (GatedMLP(h, cfg.shared_intermediate_size, self.alpha, self.limit)
                       if cfg.shared_intermediate_size > 0 else None)

    def route(self, x: torch.Tensor, scale: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
        return route(F.linear(x.float(), self.router), self.router_bias, self.top_k, scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """MoE(x): each token through its k experts only, in static-shape forms with no host sync (a captured step runs
        them as is). On CPU in float32 the C kernel (grouping tokens by expert itself). On CUDA Triton's two kernels
        over the (token, expert) pairs, the shared expert one more a token, unless they read much more than the
        grouped form (`PAIR_BYTES`): pairs sorted by expert through grouped matmuls where torch's grouped kernel needs
        no sync (`grouped_kernel`), else the gathered experts. NOTE: C kernel / loop over experts / all experts, 64
        tokens: 0.51 / 0.80 / 1.54 ms."""
        ids, w = self.route(x, self.scale)  # (gamma on the k weights: sum_e (gamma w_e) Expert_e(x))
        if fused.serves(x) and (not grouped_kernel(self.w13) or (ids.numel() - self.w13.shape[0]) * (
                self.w13[0].nbytes + self.w2[0].nbytes) <= PAIR_BYTES):  # (x read in the dtype it comes in)
            shared = () if self.shared is None else (self.shared.gate_up_proj, self.shared.down_proj)  # (3 kernels less)
            return fused.gathered_experts(x, ids, w, self.w13, self.w2, self.alpha, self.limit, *shared)
        x = x.to(self.w13.dtype)  # (from the router's dtype, `input_dtype`, to the experts')
        if on_kernel(x, self.w13, self.w2):
            routed = moe_experts(x, ids, w, self.w13, self.w2, self.alpha, self.limit)
        elif grouped_kernel(x):
            routed = self._grouped(x, ids, w)
        else:
            routed = gathered_experts(x, ids, w, self.w13, self.w2, self.alpha, self.limit)
        return routed if self.shared is None else self.shared(x, plus=routed)

    def _grouped(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """The T*k (token, expert) pairs sorted by expert, then one grouped matmul per projection: each pair
        multiplies its own expert's weights only (T*k expert products, whatever E), with shapes fixed by T."""
        t, k = ids.shape
        experts, order = torch.sort(ids.reshape(-1), stable=True)
        ends = torch.searchsorted(experts, torch.arange(1, self.w13.shape[0] + 1, device=x.device), out_int32=True)
        h = swiglu_oai(torch._grouped_mm(x[order // k], self.w13.transpose(1, 2), offs=ends), self.alpha, self.limit)
        y = torch._grouped_mm(h, self.w2.transpose(1, 2), offs=ends) * w.reshape(-1)[order].to(x.dtype)[:, None]
        out = torch.empty(t * k, x.shape[-1], dtype=y.dtype, device=y.device).index_copy_(0, order, y)  # (every row)
        return out.view(t, k, -1).sum(dim=1)
