"""Tiny random MiniMax-M3 checkpoints built with transformers (the independent reference), plus a
converter to the original MiniMax layout (model.md §6) so both loaders paths can be compared."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM, MiniMaxM3VLTextConfig

# name -> kwargs of MiniMaxM3VLTextConfig. Block sizes 4-16, top-k 2-4, GQA ratios 2 and 4.
HF_CONFIGS: dict[str, dict] = {
    "all_dense": dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                      layer_types=["full_attention"] * 3, mlp_layer_types=["dense", "sparse", "sparse"],
                      index_block_size=4, index_topk_blocks=2, partial_rotary_factor=1.0),
    "mixed_b4_gqa4": dict(num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                          layer_types=["full_attention", "minimax_m3_sparse", "full_attention", "minimax_m3_sparse"],
                          mlp_layer_types=["dense", "sparse", "sparse", "dense"],
                          index_block_size=4, index_topk_blocks=2, index_local_blocks=1, partial_rotary_factor=0.5),
    "sparse_b16_k4": dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                          layer_types=["minimax_m3_sparse"] * 3, mlp_layer_types=["sparse", "dense", "sparse"],
                          index_block_size=16, index_topk_blocks=4, index_local_blocks=2, partial_rotary_factor=0.5),
    "sparse_b8_k3_gqa4": dict(num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=2,
                              layer_types=["full_attention", "minimax_m3_sparse"], mlp_layer_types=["sparse", "sparse"],
                              index_block_size=8, index_topk_blocks=3, index_local_blocks=1, partial_rotary_factor=0.25),
}


def make_hf_config(name: str) -> MiniMaxM3VLTextConfig:
    kw = dict(HF_CONFIGS[name])
    factor = kw.pop("partial_rotary_factor")
    return MiniMaxM3VLTextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=32, head_dim=16, dense_intermediate_size=48,
        shared_intermediate_size=24, num_local_experts=6, num_experts_per_tok=2, index_n_heads=kw["num_key_value_heads"],
        index_head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": factor},
        max_position_embeddings=4096, **kw)


def build_hf_model(name: str, out_dir: Path, seed: int = 0) -> MiniMaxM3VLForCausalLM:
    """A transformers model with every weight random (norms and router bias included), saved to out_dir."""
    torch.manual_seed(seed)
    model = MiniMaxM3VLForCausalLM(make_hf_config(name)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            std = 0.3 if p.dim() == 1 else (1.0 if "embed" in pname else 1.0 / p.shape[-1] ** 0.5)
            p.copy_(torch.randn(p.shape, generator=gen) * std)
        for mod in model.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(torch.randn(mod.e_score_correction_bias.shape, generator=gen) * 0.1)
    model.save_pretrained(out_dir)
    return model


def to_original_layout(native_dir: Path, out_dir: Path) -> None:
    """Rename a transformers-native checkpoint to the original MiniMax names and config shape."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((native_dir / "config.json").read_text())
    sd = load_file(str(native_dir / "model.safetensors"))
    new: dict[str, torch.Tensor] = {}
    for k, t in sd.items():
        if ".self_attn.indexer." in k:
            new[k.replace(".indexer.", ".index_")] = t
        elif ".mlp.experts.gate_up_proj" in k:
            base = k.replace(".mlp.experts.gate_up_proj", ".block_sparse_moe.experts")
            for e in range(t.shape[0]):
                gate, up = t[e].chunk(2, dim=0)
                new[f"{base}.{e}.w1.weight"], new[f"{base}.{e}.w3.weight"] = gate.clone(), up.clone()
        elif ".mlp.experts.down_proj" in k:
            base = k.replace(".mlp.experts.down_proj", ".block_sparse_moe.experts")
            for e in range(t.shape[0]):
                new[f"{base}.{e}.w2.weight"] = t[e].clone()
        elif ".mlp.gate.e_score_correction_bias" in k:
            new[k.replace(".mlp.gate.", ".block_sparse_moe.")] = t
        elif ".mlp.gate.weight" in k:
            new[k.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t
        elif ".gate_up_proj.weight" in k:
            prefix = k.replace(".mlp.shared_experts.", ".block_sparse_moe.shared_experts.").replace(".gate_up_proj.weight", "")
            gate, up = t.chunk(2, dim=0)
            new[f"{prefix}.gate_proj.weight"], new[f"{prefix}.up_proj.weight"] = gate.clone(), up.clone()
        else:
            new[k.replace(".mlp.shared_experts.", ".block_sparse_moe.shared_experts.")] = t
    save_file(new, str(out_dir / "model.safetensors"))
    n = cfg["num_hidden_layers"]
    sparse = [int(t == "minimax_m3_sparse") for t in cfg["layer_types"]]
    original = {k: v for k, v in cfg.items() if not k.startswith("index_") and k not in (
        "layer_types", "mlp_layer_types", "rope_parameters", "model_type", "rotary_dim")}
    original.update(
        model_type="minimax_m3", hidden_act="swigluoai", rope_theta=cfg["rope_parameters"]["rope_theta"],
        rotary_dim=int(cfg["head_dim"] * cfg["rope_parameters"].get("partial_rotary_factor", 1.0)),
        moe_layer_freq=[int(t == "sparse") for t in cfg["mlp_layer_types"]],
        sparse_attention_config={
            "use_sparse_attention": any(sparse), "sparse_attention_freq": sparse,
            "sparse_disable_index_value": [1] * n, "sparse_num_index_heads": cfg["index_n_heads"],
            "sparse_index_dim": cfg["index_head_dim"], "sparse_block_size": cfg["index_block_size"],
            "sparse_topk_blocks": cfg["index_topk_blocks"], "sparse_local_block": cfg["index_local_blocks"],
            "sparse_init_block": 0, "sparse_score_type": "max"})
    (out_dir / "config.json").write_text(json.dumps(original, indent=2))
