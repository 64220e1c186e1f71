"""Bytes one decode step must read per token (weights actually used + KV at a given context), from
the config alone; the decode roofline is bandwidth / these bytes."""

from __future__ import annotations

from engine.model.config import ModelConfig

ROUTER_BYTES = 4  # the router weight and bias stay fp32 whatever the model dtype


def _mlp(hidden: int, inter: int) -> int:
    return 3 * hidden * inter  # [gate | up] (2I x H) + down (H x I)


def weight_bytes(cfg: ModelConfig, elt: int) -> dict[str, int]:
    """Weight bytes read per decoded token, by part: only the routed experts a token uses."""
    h, d, di = cfg.hidden_size, cfg.head_dim, cfg.index_head_dim
    parts = {"embedding_row": h * elt, "attention": 0, "layer_norms": 0, "dense_mlp": 0, "router": 0,
             "routed_experts": 0, "shared_expert": 0, "final_norm": h * elt, "lm_head": cfg.vocab_size * h * elt}
    for i, kind in enumerate(cfg.layer_kinds):
        rows = (cfg.num_heads + 2 * cfg.num_kv_heads) * d  # q, k, v
        o_in = cfg.num_heads * d
        norms = 2 * d  # q_norm, k_norm
        if kind != "dense":
            rows += cfg.index_num_heads * di + di  # index q, index k
            norms += 2 * di
        if kind == "sparse_index_kv":
            rows += di  # index v
            o_in += cfg.index_num_heads * di  # index o
        parts["attention"] += (rows * h + h * o_in + norms) * elt
        parts["layer_norms"] += 2 * h * elt
        if cfg.moe_layers[i]:
            parts["router"] += (cfg.num_experts * h + cfg.num_experts) * ROUTER_BYTES
            parts["routed_experts"] += cfg.num_experts_per_tok * _mlp(h, cfg.intermediate_size) * elt
            parts["shared_expert"] += _mlp(h, cfg.shared_intermediate_size) * elt
        else:
            parts["dense_mlp"] += _mlp(h, cfg.dense_intermediate_size) * elt
    return parts


def kv_bytes(cfg: ModelConfig, context: float, elt: int) -> dict[str, float]:
    """KV bytes one decode step reads at `context` tokens, by part.

    Dense layers: main K/V over the whole context. Sparse layers: main K/V of the top-k x block_size
    selected keys (the whole context when shorter), the index K over the whole context, and the
    index V over the whole context on index-value layers (its branch is dense, model.md §4).
    """
    main_row = 2 * cfg.num_kv_heads * cfg.head_dim * elt
    selected = min(context, cfg.topk_blocks * cfg.block_size)
    parts = {"dense_main_kv": 0.0, "sparse_main_kv": 0.0, "index_k": 0.0, "index_v": 0.0}
    for kind in cfg.layer_kinds:
        if kind == "dense":
            parts["dense_main_kv"] += context * main_row
            continue
        parts["sparse_main_kv"] += selected * main_row
        parts["index_k"] += context * cfg.index_head_dim * elt
        if kind == "sparse_index_kv":
            parts["index_v"] += context * cfg.index_head_dim * elt
    return parts


def decode_bytes_per_token(cfg: ModelConfig, context: float, elt: int) -> dict:
    w, kv = weight_bytes(cfg, elt), kv_bytes(cfg, context, elt)
    return {"context": context, "weights": w, "kv": kv, "weights_total": sum(w.values()),
            "kv_total": sum(kv.values()), "total": sum(w.values()) + sum(kv.values())}
