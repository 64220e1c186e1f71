"""The training forward of our model: whole sequences [B, T], dense tensors, autograd, no KV pool.

It reads the engine model's own parameters and calls the engine's math (norms, RoPE, SwiGLU-OAI,
routing, the indexer's block scores and selection), so the only new code is the dense attention
layout; `tests/test_training.py` checks its logits against the engine's paged forward within 1e-4.

Sparse layers attend to their selected blocks exactly as the engine does. The indexer gets a
training signal (its top-k is not differentiable): a KL divergence from the main attention's mass
per block (summed over each KV group's query heads, no gradient) to the softmax of its block scores,
computed from a detached input so that it trains only the indexer (DeepSeek-V3.2's recipe, per block).
In the joint stages both distributions cover every visible block; in the indexer-only stage
(training/indexer.py) only the blocks the selection is free to choose (the init and local blocks are
always kept), which is where its choice lies.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from engine.model.indexer import block_masks, block_scores, select_blocks
from engine.model.layers import MoE, apply_rope, rms_norm
from engine.model.model import Attention, MiniMaxM3Model

NEG_INF = float("-inf")


@dataclass
class Aux:
    indexer_kl: list[torch.Tensor] = field(default_factory=list)  # one mean KL per sparse layer
    recall: list[torch.Tensor] = field(default_factory=list)  # per sparse layer (bench/quality.py)
    routes: list[torch.Tensor] = field(default_factory=list)  # expert ids [B*T, k] per MoE layer


def forward(model: MiniMaxM3Model, ids: torch.Tensor, indexer_loss: bool = True,
            indexer_only: bool = False) -> tuple[torch.Tensor, Aux]:
    """Logits [B, T, V] (fp32) of token ids [B, T] (each row a sequence from position 0), and the aux terms.
    indexer_only: the model runs without autograd and only the score-only layers' KL terms carry a gradient
    (training/indexer.py: their index q/k feed nothing but the block selection)."""
    with torch.set_grad_enabled(torch.is_grad_enabled() and not indexer_only):
        return _forward(model, ids, indexer_loss, indexer_only)


def _forward(model: MiniMaxM3Model, ids: torch.Tensor, indexer_loss: bool, indexer_only: bool):
    b, t = ids.shape
    aux = Aux()
    x = model.embed_tokens(ids).view(b * t, -1)
    rot = model.rope_table[torch.arange(t, device=ids.device).repeat(b)].to(x.dtype)
    causal = torch.ones(t, t, dtype=torch.bool, device=ids.device).tril()
    for layer in model.layers:
        y = layer.input_layernorm(x)
        x = x + _attention(layer.self_attn, y, rot, b, t, causal, aux, indexer_loss, indexer_only)
        y = layer.post_attention_layernorm(x)
        if isinstance(layer.mlp, MoE):
            with torch.autocast(x.device.type, enabled=False):  # (fp32 routing, as the engine's: model.md §7.12)
                r, w = layer.mlp.route(y)
            aux.routes.append(r)
            out = layer.mlp._grouped(y, r, w) * layer.mlp.scale
            x = x + (out if layer.mlp.shared is None else out + layer.mlp.shared(y))
        else:
            x = x + layer.mlp(y)
    return model.compute_logits(model.norm(x)).view(b, t, -1), aux


def _heads(a: Attention, parts: list[torch.Tensor], rot, b: int, t: int):
    c = a.cfg

    def head(y: torch.Tensor, n: int, norm: torch.Tensor) -> torch.Tensor:  # [B*T, n, d] -> [B, n, T, d]
        h = apply_rope(rms_norm(y.reshape(b * t, n, -1), norm, c.rms_norm_eps), rot)
        return h.view(b, t, n, -1).transpose(1, 2)

    q, k = head(parts[0], c.num_heads, a.q_norm), head(parts[1], c.num_kv_heads, a.k_norm)
    v = parts[-2 if a.kind == "sparse_index_kv" else -1].view(b, t, c.num_kv_heads, -1).transpose(1, 2)
    iq = ik = None
    if a.kind != "dense":
        iq, ik = head(parts[2], c.index_num_heads, a.index_q_norm), head(parts[3], 1, a.index_k_norm)
    return q, k, v, iq, ik, head


def _attention(a: Attention, x: torch.Tensor, rot, b: int, t: int, causal: torch.Tensor, aux: Aux,
               indexer_loss: bool, indexer_only: bool) -> torch.Tensor:
    c = a.cfg
    parts = list(F.linear(x, a.qkv_proj).split(a.splits, dim=-1))
    q, k, v, iq, ik, head = _heads(a, parts, rot, b, t)
    scale, g = c.head_dim ** -0.5, c.num_heads // c.num_kv_heads
    if a.kind == "dense" or t <= c.topk_blocks * c.block_size:  # every visible block selected: dense
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
    else:
        pos = torch.arange(t, device=x.device)
        with torch.no_grad(), torch.autocast(x.device.type, enabled=False):  # (fp32 scores, as the engine's)
            scores = block_scores(iq.transpose(1, 2), ik[:, 0], causal.expand(b, t, t), c.block_size)
            blocks = select_blocks(scores, block_masks(pos.expand(b, t), scores.shape[-1], c.block_size, c.topk_blocks,
                                                       c.init_blocks, c.local_blocks))  # [B, n_kv, T, K]
            keep = torch.zeros(b, c.num_kv_heads, t, scores.shape[-1] + 1, dtype=torch.bool, device=x.device)
            keep.scatter_(-1, torch.where(blocks < 0, scores.shape[-1], blocks), True)  # -1 -> a spare column
            keep = keep[..., :-1].repeat_interleave(c.block_size, dim=-1)[..., :t] & causal
        fold = b * c.num_kv_heads  # NOTE: each KV group as a batch row, so that its g query heads share one mask
        o = F.scaled_dot_product_attention(  # (not g copies of it: a step of 4 x 2,048 tokens 11-15 -> 8.3-9.2 s)
            q.reshape(fold, g, t, -1), k.reshape(fold, 1, t, -1), v.reshape(fold, 1, t, -1),
            attn_mask=keep.view(fold, 1, t, t), scale=scale, enable_gqa=True).view(b, c.num_heads, t, -1)
    if a.kind != "dense" and indexer_loss and t > c.block_size and (not indexer_only or a.kind == "sparse_k_only"):
        with torch.set_grad_enabled(torch.is_grad_enabled() or indexer_only):
            kl, mass = _indexer_kl(a, x, rot, q, k, b, t, causal, head, free_only=indexer_only)
        aux.indexer_kl.append(kl)
        if t > c.topk_blocks * c.block_size:
            aux.recall.append(_recall(mass, blocks, c.topk_blocks, c.block_size))
    o = o.transpose(1, 2).reshape(b * t, -1)
    if a.kind == "sparse_index_kv":  # index-value branch: dense causal over the whole history
        iv = parts[-1].view(b, t, 1, -1).transpose(1, 2)
        u = F.scaled_dot_product_attention(iq, ik, iv, is_causal=True, scale=c.index_head_dim ** -0.5, enable_gqa=True)
        o = torch.cat([o, u.transpose(1, 2).reshape(b * t, -1)], dim=-1)
    return F.linear(o, a.o_proj)


def _recall(mass: torch.Tensor, blocks: torch.Tensor, topk: int, block_size: int) -> torch.Tensor:
    """The share of the true top-k blocks' attention mass that the chosen blocks hold, mean over the
    queries that see more than top-k blocks. mass [B, n_kv, T, nb], blocks [B, n_kv, T, K] (-1 unused)."""
    chosen = (mass.gather(-1, blocks.clamp(min=0)) * (blocks >= 0)).sum(-1)
    best = mass.topk(topk, dim=-1).values.sum(-1)
    return (chosen / best)[:, :, topk * block_size:].mean()


def block_mass(q: torch.Tensor, k: torch.Tensor, block_size: int, scale: float) -> torch.Tensor:
    """Causal attention mass per key block of each KV group's query heads, normalized: q [B, H, T, D], k [B, n_kv,
    T, D] -> [B, n_kv, T, nb] (fp32). NOTE: attention over one-hot block values, so no T x T matrix is built: a
    step of 4 x 2,048 tokens with the indexer's term 22 -> 11-14 s against softmax(q k^T) summed by block."""
    b, kv, t, d = k.shape
    nb = -(-t // block_size)
    onehot = F.one_hot(torch.arange(t, device=q.device) // block_size, nb + -nb % d).float()  # [T, nb padded]
    with torch.autocast(q.device.type, enabled=False):  # (values as wide as the keys: SDPA's fused kernel)
        mass = torch.cat([F.scaled_dot_product_attention(q.float(), k.float(), cols.expand(b, kv, t, d),
                                                         is_causal=True, scale=scale, enable_gqa=True)
                          for cols in onehot.split(d, dim=1)], dim=-1)[..., :nb]
    mass = mass.view(b, kv, -1, t, nb).sum(2)
    return mass / mass.sum(-1, keepdim=True)


def _indexer_kl(a: Attention, x: torch.Tensor, rot, q: torch.Tensor, k: torch.Tensor, b: int, t: int,
                causal: torch.Tensor, head, free_only: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """KL(main attention mass per block || softmax of the indexer's block scores) over every visible block, or
    (free_only) over the blocks neither init nor local, mean over the queries that have such blocks; and the
    mass per block [B, n_kv, T, nb] over every block (for the recall)."""
    c, bs = a.cfg, a.cfg.block_size
    nb = -(-t // bs)
    with torch.no_grad():
        mass = block_mass(q, k, bs, c.head_dim ** -0.5)
        visible = torch.arange(t, device=x.device)[:, None] // bs + 1  # V_t, [T, 1]
        blk = torch.arange(nb, device=x.device)
        free = blk < visible  # [T, nb]
        if free_only:
            free &= (blk >= c.init_blocks) & (blk < visible - c.local_blocks)
        target = mass * free
        target = target / target.sum(-1, keepdim=True).clamp_min(1e-30)
    rows = F.linear(x.detach(), a.qkv_proj[sum(a.splits[:2]):sum(a.splits[:4])])  # index q, k only
    iq, ik = head(rows[:, :a.splits[2]], c.index_num_heads, a.index_q_norm), head(rows[:, a.splits[2]:], 1, a.index_k_norm)
    with torch.autocast(x.device.type, enabled=False):  # (fp32 scores, as the engine's)
        scores = block_scores(iq.transpose(1, 2), ik[:, 0], causal.expand(b, t, t), bs)  # [B, n_I, T, nb]
    logq = torch.log_softmax(scores.masked_fill(~free, NEG_INF), dim=-1)
    kl = torch.where(target > 0, target * (target.clamp_min(1e-30).log() - logq), torch.zeros_like(target))
    return kl.sum(-1)[:, :, free.any(-1)].mean(), mass
