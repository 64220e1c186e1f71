"""Model directories for the run: the transformers copy of configs/tiny's weights, its all-dense
variant, and loading the copy into transformers."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from bench.context import ModelDirs
from bench.hf_copy import write_hf_copy
from engine.model.loader import load_model

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "generation_config.json")


def write_dense_variant(copy_dir: Path, out_dir: Path) -> None:
    """`copy_dir`'s weights with every layer dense: a config.json with all layer_types full_attention and
    a safetensors index naming the copy's own file(s) for every tensor except the (unused) indexer ones."""
    out_dir.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((copy_dir / "config.json").read_text())
    cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    weight_map = {}
    for shard in sorted(copy_dir.glob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            weight_map.update({k: str(shard.resolve()) for k in f.keys() if ".indexer." not in k})
        # NOTE: the loader looks for a *.safetensors file before it reads the index: link one in.
        os.symlink(shard.resolve(), out_dir / shard.name)
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for name in TOKENIZER_FILES:
        if (copy_dir / name).is_file():
            shutil.copy(copy_dir / name, out_dir / name)


def prepare_model_dirs(tiny: Path, workdir: Path) -> ModelDirs:
    """Write the transformers copy of `tiny` (seeded dummy weights) and its dense variant under workdir."""
    copy_dir, dense_dir = workdir / "hf_copy", workdir / "hf_copy_dense"
    write_hf_copy(load_model(tiny), copy_dir, tiny)
    write_dense_variant(copy_dir, dense_dir)
    return ModelDirs(tiny=tiny, hf_copy=copy_dir, hf_copy_dense=dense_dir)


def load_transformers(model_dir: Path):
    """The copy in transformers, float32, eval mode, default attention implementation (sdpa)."""
    import transformers
    from transformers.models.minimax_m3_vl import MiniMaxM3VLForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return MiniMaxM3VLForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
