"""Random tiny checkpoints in the original MiniMax layout (model.md §6), with all three layer kinds."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

BASE_CONFIG: dict = {
    "architectures": ["MiniMaxM3SparseForCausalLM"], "model_type": "minimax_m3",
    "vocab_size": 384, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "rotary_dim": 8, "rope_theta": 10000.0,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-6, "hidden_act": "swigluoai",
    "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "intermediate_size": 32, "dense_intermediate_size": 48,
    "shared_intermediate_size": 24, "n_shared_experts": 1, "num_local_experts": 5, "num_experts_per_tok": 2,
    "scoring_func": "sigmoid", "use_routing_bias": True, "routed_scaling_factor": 2.0,
    "moe_layer_freq": [0, 1, 1, 1], "tie_word_embeddings": False, "eos_token_id": 1, "bos_token_id": 0,
    "sparse_attention_config": {
        "use_sparse_attention": True, "sparse_attention_freq": [0, 1, 1, 1],
        "sparse_disable_index_value": [0, 0, 1, 0], "sparse_num_index_heads": 2, "sparse_index_dim": 16,
        "sparse_topk_blocks": 3, "sparse_block_size": 4, "sparse_init_block": 1, "sparse_local_block": 1,
        "sparse_score_type": "max",
    },
}


def make_config(**sparse_overrides) -> dict:
    cfg = copy.deepcopy(BASE_CONFIG)
    cfg["sparse_attention_config"].update(sparse_overrides)
    return cfg


def random_state_dict(cfg: dict, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    h, nq, nkv, d = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    sc = cfg["sparse_attention_config"]
    di, ni = sc["sparse_index_dim"], sc["sparse_num_index_heads"]

    def mat(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen) / shape[-1] ** 0.5

    def vec(n: int, std: float = 0.3) -> torch.Tensor:
        return torch.randn(n, generator=gen) * std

    sd = {"model.embed_tokens.weight": torch.randn(cfg["vocab_size"], h, generator=gen),
          "model.norm.weight": vec(h), "lm_head.weight": mat(cfg["vocab_size"], h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        sd |= {p + "input_layernorm.weight": vec(h), p + "post_attention_layernorm.weight": vec(h),
               p + "self_attn.q_proj.weight": mat(nq * d, h), p + "self_attn.k_proj.weight": mat(nkv * d, h),
               p + "self_attn.v_proj.weight": mat(nkv * d, h), p + "self_attn.o_proj.weight": mat(h, nq * d),
               p + "self_attn.q_norm.weight": vec(d), p + "self_attn.k_norm.weight": vec(d)}
        if i < len(sc["sparse_attention_freq"]) and sc["sparse_attention_freq"][i]:
            sd |= {p + "self_attn.index_q_proj.weight": mat(ni * di, h), p + "self_attn.index_k_proj.weight": mat(di, h),
                   p + "self_attn.index_q_norm.weight": vec(di), p + "self_attn.index_k_norm.weight": vec(di)}
            if not sc["sparse_disable_index_value"][i]:
                sd |= {p + "self_attn.index_v_proj.weight": mat(di, h),
                       p + "self_attn.index_o_proj.weight": mat(h, ni * di)}
        if cfg["moe_layer_freq"][i]:
            e, inter, sh = cfg["num_local_experts"], cfg["intermediate_size"], cfg["shared_intermediate_size"]
            m = p + "block_sparse_moe."
            sd |= {m + "gate.weight": mat(e, h), m + "e_score_correction_bias": vec(e, 0.1)}
            for j in range(e):
                sd |= {f"{m}experts.{j}.w1.weight": mat(inter, h), f"{m}experts.{j}.w3.weight": mat(inter, h),
                       f"{m}experts.{j}.w2.weight": mat(h, inter)}
            sd |= {m + "shared_experts.gate_proj.weight": mat(sh, h), m + "shared_experts.up_proj.weight": mat(sh, h),
                   m + "shared_experts.down_proj.weight": mat(h, sh)}
        else:
            di_ = cfg["dense_intermediate_size"]
            sd |= {p + "mlp.gate_proj.weight": mat(di_, h), p + "mlp.up_proj.weight": mat(di_, h),
                   p + "mlp.down_proj.weight": mat(h, di_)}
    return sd


def write_checkpoint(out_dir: Path, cfg: dict, sd: dict[str, torch.Tensor]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    save_file(sd, str(out_dir / "model.safetensors"))
    return out_dir
