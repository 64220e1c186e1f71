"""The MiniMax-M3-style decoder (model.md §2-§4) running over the sparse KV pool.

One fused input projection per layer yields q, k, v and, on sparse layers, the indexer's q/k (and the
index value); one fused output projection maps [attention | index-value] back to the hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import attention_layer
from engine.config import ModelConfig
from engine.forward_batch import ForwardBatch
from engine.layers import GatedMLP, GemmaRMSNorm, MoE, apply_rope, rms_norm, rope_cos_sin, rope_inv_freq
from mem_cache import MiniMaxSparseKVPool


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        self.kind = cfg.layer_kinds[layer_id]
        d, di = cfg.head_dim, cfg.index_head_dim
        # Output widths of the fused projection, in order: q, k, v, index q, index k, index v.
        self.splits = [cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d]
        if self.kind != "dense":
            self.splits += [cfg.index_num_heads * di, di] + ([di] if self.kind == "sparse_index_kv" else [])
        o_in = cfg.num_heads * d + (cfg.index_num_heads * di if self.kind == "sparse_index_kv" else 0)
        self.qkv_proj = nn.Parameter(torch.empty(sum(self.splits), cfg.hidden_size))
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden_size, o_in))
        self.q_norm = nn.Parameter(torch.zeros(d))
        self.k_norm = nn.Parameter(torch.zeros(d))
        if self.kind != "dense":
            self.index_q_norm = nn.Parameter(torch.zeros(di))
            self.index_k_norm = nn.Parameter(torch.zeros(di))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                pool: MiniMaxSparseKVPool) -> torch.Tensor:
        c, t = self.cfg, x.shape[0]
        parts = F.linear(x, self.qkv_proj).split(self.splits, dim=-1)
        q = apply_rope(rms_norm(parts[0].view(t, c.num_heads, c.head_dim), self.q_norm, c.rms_norm_eps), cos, sin)
        k = apply_rope(rms_norm(parts[1].view(t, c.num_kv_heads, c.head_dim), self.k_norm, c.rms_norm_eps), cos, sin)
        v = parts[2].view(t, c.num_kv_heads, c.head_dim)
        pool.set_kv_buffer(self.layer_id, fb.out_cache_loc, k, v)
        iq = None
        if self.kind != "dense":
            di = c.index_head_dim
            iq = apply_rope(rms_norm(parts[3].view(t, c.index_num_heads, di), self.index_q_norm, c.rms_norm_eps), cos, sin)
            ik = apply_rope(rms_norm(parts[4].view(t, 1, di), self.index_k_norm, c.rms_norm_eps), cos, sin)
            if self.kind == "sparse_index_kv":
                pool.set_index_kv_buffer(self.layer_id, fb.out_cache_loc, ik, parts[5].view(t, 1, di))
            else:
                pool.set_index_k_buffer(self.layer_id, fb.out_cache_loc, ik)
        o, u = attention_layer(self.layer_id, q, iq, fb, pool, c)
        return F.linear(o if u is None else torch.cat([o, u], dim=-1), self.o_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.mlp: nn.Module = (MoE(cfg) if cfg.moe_layers[layer_id] else
                               GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size, cfg.swiglu_alpha, cfg.swiglu_limit))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fb: ForwardBatch,
                pool: MiniMaxSparseKVPool) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, fb, pool)
        return h + self.mlp(self.post_attention_layernorm(h))


class MiniMaxM3Model(nn.Module):
    """Token ids -> final hidden states (`forward`) -> logits (`compute_logits`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size)))
        self.register_buffer("inv_freq", rope_inv_freq(cfg.rotary_dim, cfg.rope_theta), persistent=False)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, pool: MiniMaxSparseKVPool) -> torch.Tensor:
        x = self.embed_tokens(fb.input_ids)
        cos, sin = rope_cos_sin(fb.positions, self.inv_freq, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin, fb, pool)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for the given final hidden states [n, H]."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        return F.linear(hidden, w).float()
