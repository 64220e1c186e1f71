"""A naive whole-matrix MiniMax-M3 forward written straight from model.md, for what transformers lacks
(init blocks, the index-value branch). No pool, no fusion, explicit per-token block selection.

Reads weights by their original checkpoint names (model.md §6) from a plain state dict.
"""

from __future__ import annotations

import math

import torch


def _gn(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1 + w)


def _act(gate: torch.Tensor, up: torch.Tensor, alpha: float, lim: float) -> torch.Tensor:
    g = torch.clamp(gate, max=lim)
    return g * torch.sigmoid(alpha * g) * (torch.clamp(up, -lim, lim) + 1)


def _selected_blocks(iq_t: torch.Tensor, ik: torch.Tensor, t: int, sc: dict) -> set[int]:
    """S_{t,h} for one query token and one index head (model.md §3.2-§3.3), by explicit loops."""
    b_size, k, li, ll = sc["sparse_block_size"], sc["sparse_topk_blocks"], sc["sparse_init_block"], sc["sparse_local_block"]
    visible = t // b_size + 1
    scores = ik[: t + 1] @ iq_t
    ranked = []
    for b in range(visible):
        best = max(scores[j].item() for j in range(b * b_size, min((b + 1) * b_size, t + 1)))
        tier = 0 if b < min(li, visible) else (1 if b >= visible - ll else 2)
        ranked.append((tier, -best if tier == 2 else 0.0, b))
    return {b for _, _, b in sorted(ranked)[: min(k, visible)]}


def naive_logits(sd: dict[str, torch.Tensor], cfg: dict, ids: list[int]) -> torch.Tensor:
    n, nq, nkv, d = len(ids), cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    eps, r, g_size = cfg["rms_norm_eps"], cfg["rotary_dim"], nq // nkv
    sc = cfg["sparse_attention_config"]
    di, n_i, b_size = sc["sparse_index_dim"], sc["sparse_num_index_heads"], sc["sparse_block_size"]
    inv = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, r, 2).double() / r))
    ang = torch.arange(n).double()[:, None] * inv[None]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]

    def rope(x: torch.Tensor) -> torch.Tensor:
        u, w = x[..., : r // 2], x[..., r // 2: r]
        return torch.cat([u * cos - w * sin, w * cos + u * sin, x[..., r:]], dim=-1)

    def w(name: str) -> torch.Tensor:
        return sd[name].double()

    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    x = w("model.embed_tokens.weight")[torch.tensor(ids)]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}."
        a = _gn(x, w(p + "input_layernorm.weight"), eps)
        q = rope(_gn((a @ w(p + "self_attn.q_proj.weight").T).view(n, nq, d), w(p + "self_attn.q_norm.weight"), eps))
        k = rope(_gn((a @ w(p + "self_attn.k_proj.weight").T).view(n, nkv, d), w(p + "self_attn.k_norm.weight"), eps))
        v = (a @ w(p + "self_attn.v_proj.weight").T).view(n, nkv, d)
        sparse = layer < len(sc["sparse_attention_freq"]) and sc["sparse_attention_freq"][layer]
        masks = [causal.clone() for _ in range(nkv)]
        extra = 0
        if sparse:
            iq = rope(_gn((a @ w(p + "self_attn.index_q_proj.weight").T).view(n, n_i, di), w(p + "self_attn.index_q_norm.weight"), eps))
            ik = rope(_gn((a @ w(p + "self_attn.index_k_proj.weight").T).view(n, 1, di), w(p + "self_attn.index_k_norm.weight"), eps))[:, 0]
            for g in range(nkv):
                for t in range(n):
                    chosen = _selected_blocks(iq[t, g], ik, t, sc)
                    for j in range(t + 1):
                        masks[g][t, j] = (j // b_size) in chosen
            if p + "self_attn.index_v_proj.weight" in sd:
                iv = a @ w(p + "self_attn.index_v_proj.weight").T
                s = torch.einsum("thd,jd->htj", iq, ik) / math.sqrt(di)
                u = torch.softmax(s.masked_fill(~causal, float("-inf")), dim=-1) @ iv  # [n_i, T, D_I]
                extra = u.transpose(0, 1).reshape(n, n_i * di) @ w(p + "self_attn.index_o_proj.weight").T
        o = torch.empty(n, nq, d, dtype=torch.float64)
        for i in range(nq):
            g = i // g_size
            s = (q[:, i] @ k[:, g].T) / math.sqrt(d)
            o[:, i] = torch.softmax(s.masked_fill(~masks[g], float("-inf")), dim=-1) @ v[:, g]
        x = x + o.reshape(n, nq * d) @ w(p + "self_attn.o_proj.weight").T + extra
        m = _gn(x, w(p + "post_attention_layernorm.weight"), eps)
        alpha, lim = cfg["swiglu_alpha"], cfg["swiglu_limit"]
        moe = cfg["moe_layer_freq"][layer]
        if not moe:
            x = x + _act(m @ w(p + "mlp.gate_proj.weight").T, m @ w(p + "mlp.up_proj.weight").T, alpha, lim) @ w(p + "mlp.down_proj.weight").T
            continue
        e = p + "block_sparse_moe."
        s = torch.sigmoid(m @ w(e + "gate.weight").T)
        choice = torch.topk(s + w(e + "e_score_correction_bias"), cfg["num_experts_per_tok"], dim=-1).indices
        routed = torch.zeros_like(m)
        for t in range(n):
            weights = s[t, choice[t]] / s[t, choice[t]].sum()
            for ex, wt in zip(choice[t].tolist(), weights):
                ep = f"{e}experts.{ex}."
                y = _act(m[t] @ w(ep + "w1.weight").T, m[t] @ w(ep + "w3.weight").T, alpha, lim) @ w(ep + "w2.weight").T
                routed[t] += wt * y
        sh = e + "shared_experts."
        shared = _act(m @ w(sh + "gate_proj.weight").T, m @ w(sh + "up_proj.weight").T, alpha, lim) @ w(sh + "down_proj.weight").T
        x = x + cfg["routed_scaling_factor"] * routed + shared
    return (_gn(x, w("model.norm.weight"), eps) @ w("lm_head.weight").T).float()
