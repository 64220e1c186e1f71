"""Where each of our parameters comes from in a checkpoint, for both layouts (model.md §6). A `Recipe` lists the
checkpoint tensors (with the shape the config implies for each) and how to combine them into one of our fused
parameters; each parameter has one recipe per layout, and the loader takes the first whose tensors are all present."""

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from operator import itemgetter

import torch

from engine.model.config import ModelConfig

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Recipe:
    keys: tuple[tuple[str, Shape], ...]
    combine: Callable[[list[torch.Tensor]], torch.Tensor]


_one, _rows, _cols = itemgetter(0), partial(torch.cat, dim=0), partial(torch.cat, dim=1)


def _stack_pairs(ts: list[torch.Tensor]) -> torch.Tensor:  # [w1_0, w3_0, w1_1, w3_1, ...] -> [E, 2I, H]
    return torch.stack([torch.cat(ts[i:i + 2], dim=0) for i in range(0, len(ts), 2)])


def _single(key: str, shape: Shape) -> Recipe:
    return Recipe(((key, shape),), _one)


def _mlp(prefix: str, hidden: int, inter: int) -> dict[str, list[Recipe]]:
    gate_up = [_single(f"{prefix}.gate_up_proj.weight", (2 * inter, hidden)),
               Recipe(((f"{prefix}.gate_proj.weight", (inter, hidden)), (f"{prefix}.up_proj.weight", (inter, hidden))), _rows)]
    return {"gate_up_proj": gate_up, "down_proj": [_single(f"{prefix}.down_proj.weight", (hidden, inter))]}


def recipes(cfg: ModelConfig) -> dict[str, list[Recipe]]:
    """Our parameter name -> the recipes that can fill it, in order of preference."""
    h, d, di = cfg.hidden_size, cfg.head_dim, cfg.index_head_dim
    out: dict[str, list[Recipe]] = {"embed_tokens.weight": [_single("model.embed_tokens.weight", (cfg.vocab_size, h))],
                                    "norm.weight": [_single("model.norm.weight", (h,))]}
    if not cfg.tie_word_embeddings:
        out["lm_head"] = [_single("lm_head.weight", (cfg.vocab_size, h))]
    for i, kind in enumerate(cfg.layer_kinds):
        p, ours = f"model.layers.{i}", f"layers.{i}"
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{ours}.{norm}.weight"] = [_single(f"{p}.{norm}.weight", (h,))]
        a = f"{p}.self_attn"  # (the fused projection's row order: see model.py)
        qk = ((f"{a}.q_proj.weight", (cfg.num_heads * d, h)), (f"{a}.k_proj.weight", (cfg.num_kv_heads * d, h)))
        v = ((f"{a}.v_proj.weight", (cfg.num_kv_heads * d, h)),)
        o_main = ((f"{a}.o_proj.weight", (h, cfg.num_heads * d)),)
        out.update({f"{ours}.self_attn.{n}_norm": [_single(f"{a}.{n}_norm.weight", (d,))] for n in ("q", "k")})
        if kind == "dense":
            out[f"{ours}.self_attn.qkv_proj"] = [Recipe(qk + v, _rows)]
            out[f"{ours}.self_attn.o_proj"] = [Recipe(o_main, _one)]
        else:
            iq, ik = (cfg.index_num_heads * di, h), (di, h)
            value = ((f"{a}.index_v_proj.weight", (di, h)),) if kind == "sparse_index_kv" else ()
            out[f"{ours}.self_attn.qkv_proj"] = [  # (index_* or indexer.* names)
                Recipe(qk + ((f"{a}.{x}q_proj.weight", iq), (f"{a}.{x}k_proj.weight", ik)) + v + value, _rows)
                for x in ("index_", "indexer.")]
            o_index = ((f"{a}.index_o_proj.weight", (h, cfg.index_num_heads * di)),) if kind == "sparse_index_kv" else ()
            out[f"{ours}.self_attn.o_proj"] = [Recipe(o_main + o_index, _cols)]
            for n in ("q", "k"):
                out[f"{ours}.self_attn.index_{n}_norm"] = [_single(f"{a}.index_{n}_norm.weight", (di,)),
                                                           _single(f"{a}.indexer.{n}_norm.weight", (di,))]
        if not cfg.moe_layers[i]:
            out.update({f"{ours}.mlp.{k}": rs for k, rs in _mlp(f"{p}.mlp", h, cfg.dense_intermediate_size).items()})
            continue
        e, inter, m, b = cfg.num_experts, cfg.intermediate_size, f"{p}.mlp", f"{p}.block_sparse_moe"
        out[f"{ours}.mlp.router"] = [_single(f"{b}.gate.weight", (e, h)), _single(f"{m}.gate.weight", (e, h))]
        out[f"{ours}.mlp.router_bias"] = [_single(f"{b}.e_score_correction_bias", (e,)),
                                          _single(f"{m}.gate.e_score_correction_bias", (e,))]
        w13 = tuple((f"{b}.experts.{j}.w{w}.weight", (inter, h)) for j in range(e) for w in (1, 3))
        w2 = tuple((f"{b}.experts.{j}.w2.weight", (h, inter)) for j in range(e))
        out[f"{ours}.mlp.w13"] = [Recipe(w13, _stack_pairs), _single(f"{m}.experts.gate_up_proj", (e, 2 * inter, h))]
        out[f"{ours}.mlp.w2"] = [Recipe(w2, torch.stack), _single(f"{m}.experts.down_proj", (e, h, inter))]
        if cfg.shared_intermediate_size > 0:
            for prefix in (f"{b}.shared_experts", f"{m}.shared_experts"):
                for name, rs in _mlp(prefix, h, cfg.shared_intermediate_size).items():
                    out.setdefault(f"{ours}.mlp.shared.{name}", []).extend(rs)
    return out
