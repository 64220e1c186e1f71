"""The decoder's pointwise chains, the MoE's routing and experts and the sampler's race on CUDA as Triton kernels, one
each where the PyTorch forms launch several (RMSNorm 3, 4 with the residual add before it, q with k normed and rotated
and k and v written to the pool 10, SwiGLU-OAI 6, top-k routing 6, the MoE's pairs 13 grouped and its shared expert
3 more, the race 34): a bf16 tiny decode step 559 -> 107 kernels with triton_indexer's. Each computes in float32,
rounding once. Callers ask `serves`; their forms serve elsewhere, and for good after a failure."""

import importlib

import torch

from engine.kernels import triton_decode
from engine.kernels.operator import require
from engine.kernels.triton_decode import kernel_op, tl, triton

EXPERT_TILE = 32  # (activations an up program makes, outputs a down program sums: bench.gpu's moe_forms tries others)


def serves(x: torch.Tensor, *dims: int) -> bool:
    """Whether the kernels run for x (and `dims`): where triton_decode's do, and not for training (no autograd)."""
    return triton_decode.serves(x.device, *dims) and not torch.is_grad_enabled()


def _op(schema: str, fake=None, forms: str = "engine.model.layers"):  # (after a failure, the PyTorch form of the
    # same name in `forms`, looked up then: that module imports this one)
    return lambda launch: kernel_op(schema, lambda *a: getattr(importlib.import_module(forms), launch.__name__)(*a),
                                    fake)(launch)


@_op("(Tensor x, Tensor weight, float eps) -> Tensor")
def rms_norm(x, weight, eps):
    """layers.rms_norm of x [..., n] with weight [n]."""
    return _rms(x, None, weight, eps)[1]


@_op("(Tensor x, Tensor delta, Tensor weight, float eps, ScalarType? dtype=None) -> (Tensor, Tensor)",
     fake=lambda x, d, w, e, dtype=None: (torch.empty_like(x), torch.empty_like(x, dtype=dtype)))
def add_rms_norm(x, delta, weight, eps, dtype=None):
    """layers.add_rms_norm: (x + delta, its norm), one kernel."""
    return _rms(x, delta, weight, eps, dtype)


def _rms(x, delta, weight, eps, dtype=None):
    n, x = x.shape[-1], x.contiguous()
    h, out = x if delta is None else torch.empty_like(x), torch.empty_like(x, dtype=dtype)
    _rms_kernel[(x.numel() // n,)](x, x if delta is None else delta.contiguous(), weight, h, out, n, eps,
                                   N=(p := triton.next_power_of_2(n)), ADD=delta is not None,
                                   num_warps=max(4, min(16, p // 1024)))  # (a row's values in registers)
    return h, out


@_op("(Tensor y, Tensor w1, Tensor w2, int first, Tensor rot, float eps, Tensor(a!)? k_buf=None, "
     "Tensor(b!)? v_buf=None, Tensor? loc=None, Tensor? v=None) -> Tensor",
     fake=lambda y, w1, *_: y.new_empty(y.shape[0], y.shape[1] // w1.shape[0], w1.shape[0]))
def norm_rope(y, w1, w2, first, rot, eps, k_buf=None, v_buf=None, loc=None, v=None):
    """layers.norm_rope (y's and v's rows may be strided): a program a token's heads, the first also copying v."""
    (t, width), d = y.shape, w1.shape[0]
    require((k_buf is None or loc is not None and k_buf.is_contiguous() and k_buf[0].numel() == width - first * d) and
            (v is None) == (v_buf is None) and (v is None or v_buf.is_contiguous() and v_buf[0].numel() == v[0].numel()),
            "norm_rope: k_buf [slots, heads - first, d] (contiguous) with loc, and v with v_buf", y, k_buf, v, v_buf)
    y = y if y.stride(1) == 1 else y.contiguous()
    v = y[:, :0] if v is None else v.flatten(1)  # (no values: none to copy)
    v, out = v if v.stride(1) == 1 else v.contiguous(), y.new_empty(t, width // d, d)
    hp = min(16, triton.next_power_of_2(width // d))  # (heads a program: 68 heads of 128 spilled registers)
    _norm_rope_kernel[(t, triton.cdiv(width // d, hp))](
        y, w1, w2, rot.contiguous(), out, y.stride(0), width // d, first, eps, out if k_buf is None else k_buf,
        out if v_buf is None else v_buf, y if loc is None else loc.contiguous(), v, v.stride(0), v.shape[1], HP=hp,
        D=d, R=2 * rot.shape[-1], STORE=k_buf is not None, VB=min(1024, triton.next_power_of_2(v.shape[1] or 1)))
    return out


@_op("(Tensor gate_up, float alpha, float limit) -> Tensor",
     fake=lambda x, *_: x.new_empty(*x.shape[:-1], x.shape[-1] // 2))
def swiglu_oai(gate_up, alpha, limit):
    """layers.swiglu_oai of gate_up [..., 2I] -> [..., I]."""
    i, gate_up = gate_up.shape[-1] // 2, gate_up.contiguous()
    out, block = gate_up.new_empty(*gate_up.shape[:-1], i), min(1024, triton.next_power_of_2(i))
    _swiglu_kernel[(gate_up.numel() // (2 * i), triton.cdiv(i, block))](gate_up, out, i, alpha, limit, BLOCK=block)
    return out


@_op("(Tensor logits, Tensor bias, int top_k, float scale) -> (Tensor, Tensor)",
     fake=lambda x, bias, k, _: (x.new_empty(x.shape[0], k, dtype=torch.int64), x.new_empty(x.shape[0], k)))
def route(logits, bias, top_k, scale):
    """layers.route of the router's float32 logits [T, E]: ids [T, k] (descending, ties to the lower id) and w."""
    (t, e), logits = logits.shape, logits.contiguous()
    ids, w = torch.empty(t, top_k, dtype=torch.int64, device=logits.device), torch.empty_like(logits[:, :top_k])
    _route_kernel[(t,)](logits, bias, ids, w, e, scale, K=top_k, KP=triton.next_power_of_2(top_k),
                        EP=triton.next_power_of_2(e))
    return ids, w


@_op("(Tensor x, Tensor ids, Tensor w, Tensor w13, Tensor w2, float alpha, float limit, Tensor? s13=None, "
     "Tensor? s2=None) -> Tensor", fake=lambda x, ids, w, w13, w2, *_: w2.new_empty(x.shape))
def gathered_experts(x, ids, w, w13, w2, alpha, limit, s13=None, s2=None):
    """layers.gathered_experts in two kernels, each (token, expert) pair reading its expert's rows in place (the shared
    expert s13, s2 one more pair a token, of weight 1): every pair's activations, then each token's weighted sum."""
    (t, h), (k, i), x, ids, w = x.shape, (ids.shape[1], w2.shape[2]), x.contiguous(), ids.contiguous(), w.contiguous()
    si = 0 if s2 is None else s2.shape[1]  # (the shared expert's intermediate size; 0: none)
    ks, wide = k + (si > 0), max(i, si)  # (pairs a token; an activation row's width)
    act, out = w13.new_empty(t * ks, wide), w2.new_empty(t, h)  # (x: either dtype)
    b = EXPERT_TILE
    _experts_up_kernel[(t * ks, triton.cdiv(wide, b))](x, ids, w13, w13 if s13 is None else s13, act, h, i, si, alpha,
                                                       limit, K=k, KS=ks, BI=b, BH=128, num_warps=8)
    _experts_down_kernel[(t, triton.cdiv(h, b))](act, ids, w, w2, w2 if s2 is None else s2, out, h, i, si, K=k, KS=ks,
                                                 BO=b, BI=128, num_warps=8)
    return out


@_op("(Tensor x, Tensor seeds, Tensor positions, Tensor greedy, Tensor temperature, Tensor tokens) -> Tensor",
     fake=lambda x, *_: x.new_empty(x.shape[0], dtype=torch.int64), forms="engine.runtime.sampler")
def race(x, seeds, positions, greedy, temperature, tokens):
    """sampler.race of float32 logits x [B, V] (a program a row, V in tiles)."""
    out = torch.empty(x.shape[0], dtype=torch.int64, device=x.device)
    _race_kernel[(len(x),)](x.contiguous(), seeds, positions, greedy, temperature, temperature.stride(0), tokens, out,
                            x.shape[1], BLOCK=1024)
    return out


if triton is not None:
    @triton.jit
    def _mix(x):  # (sampler._mix on uint32: its products' low 32 bits)
        x = (x ^ (x >> 16)) * 0x7FEB352D
        x = (x ^ (x >> 15)) * 0x68E31DA5
        return x ^ (x >> 16)

    @triton.jit
    def _rms_kernel(x, delta, w, h, out, n, eps, N: tl.constexpr, ADD: tl.constexpr):
        at = tl.program_id(0).to(tl.int64) * n + tl.arange(0, N)
        ok = tl.arange(0, N) < n
        v = tl.load(x + at, mask=ok, other=0.0).to(tl.float32)
        if ADD:  # (h = x + delta rounded to its dtype, as torch's add; normed as rounded)
            v = (v + tl.load(delta + at, mask=ok, other=0.0).to(tl.float32)).to(h.dtype.element_ty)
            tl.store(h + at, v, mask=ok)
            v = v.to(tl.float32)
        v = v * tl.rsqrt(tl.sum(v * v, 0) / n + eps)
        v = (v + v * tl.load(w + tl.arange(0, N), mask=ok).to(tl.float32)).to(h.dtype.element_ty)  # (x's dtype, then
        tl.store(out + at, v.to(out.dtype.element_ty), mask=ok)  # out's: the values of a norm in x's dtype)

    @triton.jit(do_not_specialize_on_alignment=["loc"])  # (the allocator's slices: any offset; one build serves all)
    def _norm_rope_kernel(y, w1, w2, rot, out, stride, heads, first, eps, k_buf, v_buf, loc, v, v_stride, vn,
                          HP: tl.constexpr, D: tl.constexpr, R: tl.constexpr, STORE: tl.constexpr, VB: tl.constexpr):
        """Token t's heads h [HP, D]: normed, and channel c < R rotated with its pair's mate c +- R/2 (model.md §3.1):
        out_c = rot[a, a] n_c + rot[a, 1 - a] n_mate (a = c >= R/2), at rot's offsets c + R*a and c + R/2; with STORE,
        heads h >= first also at k_buf's row loc[t] (head h - first), and v's vn values at v_buf's."""
        t, c = tl.program_id(0).to(tl.int64), tl.arange(0, D)[None, :]
        h = tl.program_id(1) * HP + tl.arange(0, HP)[:, None]
        ok, rotated, mate = h < heads, c < R, tl.where(c < R // 2, c + R // 2, c - R // 2)
        row = y + t * stride + h * D
        x = tl.load(row + c, mask=ok, other=0.0).to(tl.float32)
        xm = tl.load(row + mate, mask=ok & rotated, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(x * x, 1) / D + eps)[:, None]
        n = x * rstd * (1 + tl.where(h < first, tl.load(w1 + c), tl.load(w2 + c)).to(tl.float32))
        nm = xm * rstd * (1 + tl.where(h < first, tl.load(w1 + mate), tl.load(w2 + mate)).to(tl.float32))
        at = rot + t * 2 * R + c
        same = tl.load(at + tl.where(c < R // 2, 0, R), mask=rotated, other=1.0).to(tl.float32)
        cross = tl.load(at + R // 2, mask=rotated, other=0.0).to(tl.float32)
        tl.store(out + (t * heads + h) * D + c, (same * n + cross * nm).to(out.dtype.element_ty), mask=ok)
        if STORE:
            slot = tl.load(loc + t).to(tl.int64)
            tl.store(k_buf + (slot * (heads - first) + h - first) * D + c, (same * n + cross * nm).to(
                k_buf.dtype.element_ty), mask=ok & (h >= first))
            if tl.program_id(1) == 0:
                for start in range(0, vn, VB):
                    j = start + tl.arange(0, VB)
                    tl.store(v_buf + slot * vn + j, tl.load(v + t * v_stride + j, mask=j < vn), mask=j < vn)

    @triton.jit
    def _swiglu_kernel(gate_up, out, inter, alpha, limit, BLOCK: tl.constexpr):
        r, c = tl.program_id(0).to(tl.int64), tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        ok = c < inter
        g = tl.minimum(tl.load(gate_up + r * 2 * inter + c, mask=ok, other=0.0).to(tl.float32), limit)
        u = tl.load(gate_up + r * 2 * inter + inter + c, mask=ok, other=0.0).to(tl.float32)
        act = g * tl.sigmoid(alpha * g)
        tl.store(out + r * inter + c, (act + act * tl.minimum(tl.maximum(u, -limit), limit)).to(out.dtype.element_ty),
                 mask=ok)

    @triton.jit
    def _route_kernel(logits, bias, ids, w, n, scale, K: tl.constexpr, KP: tl.constexpr, EP: tl.constexpr):
        t, e, s = tl.program_id(0).to(tl.int64), tl.arange(0, EP), tl.arange(0, KP)
        score = tl.sigmoid(tl.load(logits + t * n + e, mask=e < n, other=0.0))
        key = tl.where(e < n, score + tl.load(bias + e, mask=e < n, other=0.0), float("-inf"))
        picked = tl.zeros([KP], tl.float32)
        for i in tl.static_range(K):  # (the k best keys, one at a time; tl.argmax: the first of equal ones)
            best = tl.argmax(key, 0)
            picked = tl.where(s == i, tl.sum(tl.where(e == best, score, 0.0)), picked)
            tl.store(ids + t * K + i, best.to(tl.int64))
            key = tl.where(e == best, float("-inf"), key)
        tl.store(w + t * K + s, picked / (tl.sum(picked) / scale), mask=s < K)

    @triton.jit
    def _experts_up_kernel(x, ids, w13, s13, act, n, inter, s_inter, alpha, limit, K: tl.constexpr, KS: tl.constexpr,
                           BI: tl.constexpr, BH: tl.constexpr):
        p, c = tl.program_id(0).to(tl.int64), tl.program_id(1) * BI + tl.arange(0, BI)  # (pair p, activations c)
        tok, s = p // KS, p % KS  # (s == K: the shared expert)
        width = tl.where(s == K, s_inter, inter)
        rows = tl.where(s == K, s13, w13 + tl.load(ids + tok * K + tl.minimum(s, K - 1)) * 2 * inter * n)
        rows += c[:, None] * n  # (the gate rows; the up rows `width` below)
        gate, up = tl.zeros([BI], tl.float32), tl.zeros([BI], tl.float32)
        for at in tl.range(0, n, BH, num_stages=3):  # (the next tiles load during this one: see the down kernel)
            j = at + tl.arange(0, BH)
            xv = tl.load(x + tok * n + j, mask=j < n, other=0.0).to(tl.float32)[None, :]
            ok = (c[:, None] < width) & (j[None, :] < n)
            gate += tl.sum(tl.load(rows + j[None, :], mask=ok, other=0.0).to(tl.float32) * xv, 1)
            up += tl.sum(tl.load(rows + width * n + j[None, :], mask=ok, other=0.0).to(tl.float32) * xv, 1)
        g, up = tl.minimum(gate, limit), tl.minimum(tl.maximum(up, -limit), limit)
        a = g * tl.sigmoid(alpha * g)
        tl.store(act + p * tl.maximum(inter, s_inter) + c, (a + a * up).to(act.dtype.element_ty), mask=c < width)

    @triton.jit
    def _experts_down_kernel(act, ids, w, w2, s2, out, n, inter, s_inter, K: tl.constexpr, KS: tl.constexpr,
                             BO: tl.constexpr, BI: tl.constexpr):
        t, o = tl.program_id(0).to(tl.int64), tl.program_id(1) * BO + tl.arange(0, BO)  # (token t, outputs o)
        total, wide = tl.zeros([BO], tl.float32), tl.maximum(inter, s_inter)
        chunks = tl.cdiv(wide, BI)  # (a pair's activations in chunks; one loop over them all, which the compiler
        for c in tl.range(0, KS * chunks, num_stages=3):  # pipelines: the next chunks' rows load during this one's)
            s, j = c // chunks, c % chunks * BI + tl.arange(0, BI)
            e, width = tl.load(ids + t * K + tl.minimum(s, K - 1)), tl.where(s == K, s_inter, inter)
            gate = tl.where(s == K, 1.0, tl.load(w + t * K + tl.minimum(s, K - 1)).to(tl.float32))
            av = tl.load(act + (t * KS + s) * wide + j, mask=j < width, other=0.0).to(tl.float32) * gate
            rows = tl.where(s == K, s2, w2 + e * n * inter) + o[:, None] * width
            wv = tl.load(rows + j[None, :], mask=(o[:, None] < n) & (j[None, :] < width), other=0.0)
            total += tl.sum(wv.to(tl.float32) * av[None, :], 1)
        tl.store(out + t * n + o, total.to(out.dtype.element_ty), mask=o < n)

    @triton.jit
    def _race_kernel(x, seeds, positions, greedy, temperature, t_stride, tokens, out, v, BLOCK: tl.constexpr):
        """Row r's argmax of x / t - log E over tiles (the first of equal keys), E = -log(unit(bits)) as in sampler."""
        r = tl.program_id(0).to(tl.int64)
        row = _mix((tl.load(seeds + r) ^ (tl.load(positions + r) & 0xFFFFFFFF)).to(tl.uint32))
        greedy_row, t = tl.load(greedy + r) != 0, tl.load(temperature + r * t_stride)
        best, at = float("-inf"), 0
        for start in tl.range(0, v, BLOCK, num_stages=3):  # (the next tiles load during this one)
            i = start + tl.arange(0, BLOCK)
            xv = tl.load(x + r * v + i, mask=i < v, other=float("-inf"))
            bits = _mix(row ^ tl.load(tokens + i, mask=i < v, other=0).to(tl.uint32))
            u = ((bits >> 9).to(tl.float32) + 0.5) * 1.1920928955078125e-07  # (2^-23)
            key = tl.where(i < v, tl.where(greedy_row, xv, xv / t - tl.log(-tl.log(u))), float("-inf"))
            top = tl.max(key, 0)
            at, best = tl.where(top > best, start + tl.argmax(key, 0), at), tl.maximum(best, top)
        tl.store(out + r, at.to(tl.int64))
