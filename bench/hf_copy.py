"""Write a transformers (`save_pretrained`) copy of a model's weights, so transformers and our engine
run identical numbers. transformers has no index-value branch and no init blocks: the copy keeps
every sparse layer score-only (K-only) and drops init blocks, and our engine loads the copy too."""

from __future__ import annotations

from pathlib import Path

import torch

from engine.model.config import ModelConfig
from engine.model.model import MiniMaxM3Model


def hf_config(cfg: ModelConfig):
    from transformers.models.minimax_m3_vl import MiniMaxM3VLTextConfig

    return MiniMaxM3VLTextConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        num_experts_per_tok=cfg.num_experts_per_tok, num_local_experts=cfg.num_experts,
        dense_intermediate_size=cfg.dense_intermediate_size, shared_intermediate_size=cfg.shared_intermediate_size,
        routed_scaling_factor=cfg.routed_scaling_factor, swiglu_alpha=cfg.swiglu_alpha, swiglu_limit=cfg.swiglu_limit,
        rotary_dim=cfg.rotary_dim,
        rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta,
                         "partial_rotary_factor": cfg.rotary_dim / cfg.head_dim},
        layer_types=["full_attention" if k == "dense" else "minimax_m3_sparse" for k in cfg.layer_kinds],
        mlp_layer_types=["sparse" if m else "dense" for m in cfg.moe_layers],
        index_n_heads=cfg.index_num_heads, index_head_dim=cfg.index_head_dim, index_block_size=cfg.block_size,
        index_topk_blocks=cfg.topk_blocks, index_local_blocks=cfg.local_blocks,
        bos_token_id=cfg.bos_token_id, eos_token_id=list(cfg.eos_token_ids) or None, tie_word_embeddings=False)


def hf_state_dict(model: MiniMaxM3Model) -> dict[str, torch.Tensor]:
    """Our fused parameters under transformers' names (index-value weights dropped)."""
    cfg, sd = model.cfg, {}
    d, di = cfg.head_dim, cfg.index_head_dim
    sd["model.embed_tokens.weight"] = model.embed_tokens.weight
    sd["model.norm.weight"] = model.norm.weight
    sd["lm_head.weight"] = model.lm_head
    for i, layer in enumerate(model.layers):
        p, a = f"model.layers.{i}.", layer.self_attn
        sd[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        sd[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        parts = a.qkv_proj.split(a.splits, dim=0)  # q, k, [index q, index k], v, [index v]
        sd[p + "self_attn.q_proj.weight"], sd[p + "self_attn.k_proj.weight"] = parts[:2]
        sd[p + "self_attn.v_proj.weight"] = parts[4] if a.kind != "dense" else parts[2]
        sd[p + "self_attn.o_proj.weight"] = a.o_proj[:, : cfg.num_heads * d]
        sd[p + "self_attn.q_norm.weight"], sd[p + "self_attn.k_norm.weight"] = a.q_norm, a.k_norm
        if a.kind != "dense":
            sd[p + "self_attn.indexer.q_proj.weight"], sd[p + "self_attn.indexer.k_proj.weight"] = parts[2:4]
            sd[p + "self_attn.indexer.q_norm.weight"] = a.index_q_norm
            sd[p + "self_attn.indexer.k_norm.weight"] = a.index_k_norm
        m = layer.mlp
        if cfg.moe_layers[i]:
            sd[p + "mlp.gate.weight"], sd[p + "mlp.gate.e_score_correction_bias"] = m.router, m.router_bias
            sd[p + "mlp.experts.gate_up_proj"], sd[p + "mlp.experts.down_proj"] = m.w13, m.w2
            sd[p + "mlp.shared_experts.gate_up_proj.weight"] = m.shared.gate_up_proj
            sd[p + "mlp.shared_experts.down_proj.weight"] = m.shared.down_proj
        else:
            sd[p + "mlp.gate_up_proj.weight"], sd[p + "mlp.down_proj.weight"] = m.gate_up_proj, m.down_proj
    assert di > 0
    return {k: v.detach().float().contiguous() for k, v in sd.items()}


def write_hf_copy(model: MiniMaxM3Model, out_dir: Path, tokenizer_dir: Path | None = None):
    """Save a transformers model holding `model`'s weights to out_dir; returns the transformers model."""
    import shutil

    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    hf = MiniMaxM3VLForCausalLM(hf_config(model.cfg)).eval()
    missing, unexpected = hf.load_state_dict(hf_state_dict(model), strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    hf.save_pretrained(out_dir)
    if tokenizer_dir is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
            if (tokenizer_dir / name).is_file():
                shutil.copy(tokenizer_dir / name, out_dir / name)
    return hf
