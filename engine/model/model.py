"""The MiniMax-M3-style decoder (model.md §2-§4) over the sparse KV pool: per layer, one fused input projection (q, k, v
and, on sparse layers, the indexer's q, k and index value) and one fused output projection."""

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.attention import attention, decode_masks
from engine.model.config import ModelConfig
from engine.model.forward_batch import DecodeBatch, ForwardBatch
from engine.model.layers import GatedMLP, GemmaRMSNorm, MoE, norm_rope, rope_inv_freq, rope_rotation
from mem_cache import MiniMaxSparseKVPool


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.cfg, self.layer_id, self.kind = cfg, layer_id, cfg.layer_kinds[layer_id]
        d, di = cfg.head_dim, cfg.index_head_dim
        sparse, value = self.kind != "dense", self.kind == "sparse_index_kv"
        # Fused projection rows: q, k, [index q, index k], v, [index v]: the normed and rotated first (weight_names.py).
        self.splits = ([cfg.num_heads * d, cfg.num_kv_heads * d] + ([cfg.index_num_heads * di, di] if sparse else [])
                       + [cfg.num_kv_heads * d] + ([di] if value else []))
        o_in = cfg.num_heads * d + (cfg.index_num_heads * di if value else 0)
        self.qkv_proj = nn.Parameter(torch.empty(sum(self.splits), cfg.hidden_size))
        self.o_proj = nn.Parameter(torch.empty(cfg.hidden_size, o_in))
        self.q_norm, self.k_norm = nn.Parameter(torch.zeros(d)), nn.Parameter(torch.zeros(d))
        if sparse:
            self.index_q_norm, self.index_k_norm = nn.Parameter(torch.zeros(di)), nn.Parameter(torch.zeros(di))

    def forward(self, x: torch.Tensor, rot: torch.Tensor, masks: tuple | None, batch: ForwardBatch | DecodeBatch,
                pool: MiniMaxSparseKVPool) -> torch.Tensor:
        c, t, eps, loc, i = self.cfg, x.shape[0], self.cfg.rms_norm_eps, batch.out_cache_loc, self.layer_id
        y = F.linear(x, self.qkv_proj)
        parts, qk = list(y.split(self.splits, dim=-1)), sum(self.splits[:2])
        v = parts[-2 if self.kind == "sparse_index_kv" else -1].view(t, c.num_kv_heads, c.head_dim)
        # (q and k normed and rotated; k and v written to this step's slots `loc` of the layer's pool buffers)
        q = norm_rope(y[:, :qk], self.q_norm, self.k_norm, c.num_heads, rot, eps, *pool.get_kv_buffer(i), loc, v)
        iq = None
        if self.kind != "dense":  # (the indexer's q and k alike; its v where the layer has the index-value branch)
            store = ((*pool.get_index_kv_buffer(i), loc, parts[-1].view(t, 1, -1)) if self.kind == "sparse_index_kv"
                     else (pool.get_index_k_buffer(i), None, loc))
            iq = norm_rope(y[:, qk:qk + sum(self.splits[2:4])], self.index_q_norm, self.index_k_norm,
                           c.index_num_heads, rot, eps, *store)[:, :c.index_num_heads]
        o, u = attention(i, q[:, :c.num_heads], iq, batch, pool, c, masks)
        return F.linear(o if u is None else torch.cat([o, u], dim=-1), self.o_proj)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer_id)
        self.mlp: nn.Module = (MoE(cfg) if cfg.moe_layers[layer_id] else
                               GatedMLP(cfg.hidden_size, cfg.dense_intermediate_size, cfg.swiglu_alpha, cfg.swiglu_limit))

    def forward(self, x: torch.Tensor, delta: torch.Tensor | None, rot: torch.Tensor, masks: tuple | None,
                batch: ForwardBatch | DecodeBatch, pool: MiniMaxSparseKVPool) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual stream x + delta (delta: the last layer's MLP output, None at the first layer, added here with
        the norm after it) -> (the stream with this layer's attention output added, this layer's MLP output)."""
        x, n = self.input_layernorm.add(x, delta)
        h, n = self.post_attention_layernorm.add(x, self.self_attn(n, rot, masks, batch, pool), self.mlp.input_dtype)
        return h, self.mlp(n)


class MiniMaxM3Model(nn.Module):
    """Token ids -> final hidden states (`forward`) -> logits (`compute_logits`)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Parameter(torch.empty(cfg.vocab_size, cfg.hidden_size))
        # (each position's rotation, fp32 until the loader casts it: gathered once a step, as SGLang's cos_sin_cache)
        self.register_buffer("rope_table", rope_rotation(torch.arange(cfg.max_position_embeddings), rope_inv_freq(
            cfg.rotary_dim, cfg.rope_theta), torch.float32), persistent=False)

    @torch.no_grad()
    def forward(self, batch: ForwardBatch | DecodeBatch, pool: MiniMaxSparseKVPool) -> torch.Tensor:
        x, delta = self.embed_tokens(batch.input_ids), None
        rot = self.rope_table[batch.positions].to(x.dtype)  # (once a step, for all layers; so are the masks)
        masks = decode_masks(batch, self.cfg) if isinstance(batch, DecodeBatch) else None
        for layer in self.layers:
            x, delta = layer(x, delta, rot, masks, batch, pool)
        return self.norm.add(x, delta)[1]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for the given final hidden states [n, H] (differentiable: training uses it)."""
        return F.linear(hidden, self.embed_tokens.weight if self.lm_head is None else self.lm_head).float()
