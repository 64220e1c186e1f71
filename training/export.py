"""Write a model's weights as a checkpoint in the original MiniMax layout (model.md §6), bf16.

The inverse of the loader: every fused parameter is split back into the checkpoint tensors its
recipe (engine/model/weight_names.py) combines. The router and its bias stay fp32 (model.md §7.12).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file

from engine.model import weight_names as wn
from engine.model.model import MiniMaxM3Model


def split(recipe: wn.Recipe, tensor: torch.Tensor) -> list[torch.Tensor]:
    """The checkpoint tensors `recipe.combine` would turn into `tensor`."""
    shapes = [shape for _, shape in recipe.keys]
    if recipe.combine is wn._one:
        return [tensor]
    if recipe.combine is wn._rows:
        return list(tensor.split([s[0] for s in shapes], dim=0))
    if recipe.combine is wn._cols:
        return list(tensor.split([s[1] for s in shapes], dim=1))
    if recipe.combine is torch.stack:
        return list(tensor.unbind(0))
    if recipe.combine is wn._stack_pairs:
        return [half for expert in tensor.unbind(0) for half in expert.split([shapes[0][0], shapes[1][0]], dim=0)]
    raise ValueError(f"no inverse for {recipe.combine}")


def export_safetensors(model: MiniMaxM3Model, path: Path) -> None:
    params = dict(model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    for name, options in wn.recipes(model.cfg).items():
        recipe = max(options, key=lambda r: len(r.keys))  # the unfused, original names
        for (key, shape), t in zip(recipe.keys, split(recipe, params[name].detach())):
            assert tuple(t.shape) == shape, (key, t.shape, shape)
            keep_fp32 = key.endswith(("gate.weight", "e_score_correction_bias")) and "block_sparse_moe" in key
            out[key] = t.contiguous().to(torch.float32 if keep_fp32 else torch.bfloat16)
    save_file(out, str(path), metadata={"format": "pt"})
