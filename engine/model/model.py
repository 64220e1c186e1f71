"""The MiniMax-M3-style decoder (model.md §2-§4) running over the sparse KV pool.

One fused input projection per layer yields q, k, v and, on sparse layers, the indexer's q/k (and the
index value); one fused output projection maps [attention | index-value] back to the hidden size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention import attention_layer
from engine.model.config import ModelConfig
from engine.model.forward_batch import ForwardBatch
from engine.model.layers import GatedMLP, GemmaRMSNorm, MoE, Rotary, as_dtype, rope_inv_freq
from engine.model.linear import linear
from mem_cache import MiniMaxSparseKVPool


class Attention(nn.Module):
    threads = 1  # as GatedMLP.threads

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.cfg, self.layer_id = cfg, layer_id
        self.kind = cfg.layer_kinds[layer_id]
        d, di = cfg.head_dim, cfg.index_head_dim
        sparse = self.kind != "dense"
        # Rows of the fused projection: q, k, [index q, index k], v, [index v]. The normed and rotated
        # parts come first, so one norm and one RoPE call treat them all (see `_norm_rope`).
        self.heads = [cfg.num_heads, cfg.num_kv_heads] + ([cfg.index_num_heads, 1] if sparse else [])
        self.head_dims = [d, d] + ([di, di] if sparse else [])
        self.n_rot = sum(h * hd for h, hd in zip(self.heads, self.head_dims))
        self.splits = [self.n_rot, cfg.num_kv_heads * d] + ([di] if self.kind == "sparse_index_kv" else [])
        o_in = cfg.num_heads * d + (cfg.index_num_heads * di if self.kind == "sparse_index_kv" else 0)
        self.qkv_proj = nn.Parameter(torch.empty(sum(self.splits), cfg.hidden_size))
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden_size, o_in))
        self.q_norm = nn.Parameter(torch.zeros(d))
        self.k_norm = nn.Parameter(torch.zeros(d))
        if sparse:
            self.index_q_norm = nn.Parameter(torch.zeros(di))
            self.index_k_norm = nn.Parameter(torch.zeros(di))
        self.finalize()

    def finalize(self) -> None:
        """Derive the per-head (1 + w) norm tables (fp32) from the loaded norm weights: one table per
        head width, with the column range of the fused projection it applies to."""
        norms = [self.q_norm, self.k_norm] + ([self.index_q_norm, self.index_k_norm] if self.kind != "dense" else [])
        rows = [(1.0 + w.detach().float()).expand(h, -1) for w, h in zip(norms, self.heads)]
        if len(set(self.head_dims)) == 1:
            self.rot_groups = [(0, self.n_rot, self.heads, torch.cat(rows))]
        else:  # main and index heads differ in width
            cut = sum(h * hd for h, hd in zip(self.heads[:2], self.head_dims[:2]))
            self.rot_groups = [(0, cut, self.heads[:2], torch.cat(rows[:2])),
                               (cut, self.n_rot, self.heads[2:], torch.cat(rows[2:]))]

    def _norm_rope(self, y: torch.Tensor, rope: Rotary) -> list[torch.Tensor]:
        """Per-head Gemma RMSNorm, then partial RoPE, on q, k (and index q, k); returned split by part."""
        out = []
        for start, end, heads, w in self.rot_groups:
            h = as_dtype(y[:, start:end].reshape(y.shape[0], -1, w.shape[1]), torch.float32)
            h = as_dtype(F.rms_norm(h, (w.shape[1],), eps=self.cfg.rms_norm_eps) * w, y.dtype)
            out.extend(rope(h).split(heads, dim=1))
        return out

    def forward(self, x: torch.Tensor, rope: Rotary, fb: ForwardBatch, pool: MiniMaxSparseKVPool,
                residual: torch.Tensor) -> torch.Tensor:
        """residual + attention(x): the residual add is fused into the output projection."""
        c, t = self.cfg, x.shape[0]
        parts = linear(x, self.qkv_proj, threads=self.threads).split(self.splits, dim=-1)
        rotated = self._norm_rope(parts[0], rope)
        q, k = rotated[0], rotated[1]
        v = parts[1].view(t, c.num_kv_heads, c.head_dim)
        pool.set_kv_buffer(self.layer_id, fb.out_cache_loc, k, v)
        iq = None
        if self.kind != "dense":
            iq, ik = rotated[2], rotated[3]
            if self.kind == "sparse_index_kv":
                pool.set_index_kv_buffer(self.layer_id, fb.out_cache_loc, ik, parts[2].view(t, 1, c.index_head_dim))
            else:
                pool.set_index_k_buffer(self.layer_id, fb.out_cache_loc, ik)
        o, u = attention_layer(self.layer_id, q, iq, fb, pool, c)
        return linear(o if u is None else torch.cat([o, u], dim=-1), self.o_proj, residual, threads=self.threads)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.mlp: nn.Module = (MoE(cfg) if cfg.moe_layers[layer_id] else
                               GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size, cfg.swiglu_alpha, cfg.swiglu_limit))

    def forward(self, x: torch.Tensor, rope: Rotary, fb: ForwardBatch, pool: MiniMaxSparseKVPool) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), rope, fb, pool, residual=x)
        return self.mlp(self.post_attention_layernorm(h), residual=h)


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

    threads = 1  # as GatedMLP.threads

    def finalize(self, threads: int = 1) -> None:
        """Build derived tensors (fused norm tables) once the weights are loaded and cast; `threads`:
        the CPU threads a few-row matmul is split over (see `engine.linear`)."""
        for m in self.modules():
            if m is not self and hasattr(m, "finalize"):
                m.finalize()
            if hasattr(m, "threads"):
                m.threads = threads

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, pool: MiniMaxSparseKVPool) -> torch.Tensor:
        x = self.embed_tokens(fb.input_ids)
        rope = Rotary(fb.positions, self.inv_freq, x.dtype)
        for layer in self.layers:
            x = layer(x, rope, fb, pool)
        return self.norm(x)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for the given final hidden states [n, H]."""
        w = self.embed_tokens.weight if self.lm_head is None else self.lm_head
        return linear(hidden, w, threads=self.threads).float()
