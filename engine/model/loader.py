"""Load a model: config.json + safetensors (single file or sharded) in either layout, or dummy weights. Missing,
unexpected, mis-shaped and unsupported (quantized) tensors fail with a message naming them."""

import json
import logging
import math
from functools import cache
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model.config import ModelConfig
from engine.model.config_json import load_config
from engine.model.model import MiniMaxM3Model
from engine.model.weight_names import recipes

logger = logging.getLogger(__name__)

SKIPPED_PREFIXES = ("mtp.", "vision_tower.", "multi_modal_projector.", "patch_merge_mlp.")
FP32_PARAMS = (".router", ".router_bias", "norm.weight", "_norm")  # fp32 in any dtype (model.md §7.12, and norms)


class CheckpointError(ValueError):
    """The checkpoint does not match the config; the message names the tensors."""


def _normalize(key: str) -> str | None:
    """Strip the multimodal prefix; None for keys we skip (MTP, vision)."""
    for prefix in ("language_model.", "model.language_model."):
        if key.startswith(prefix):
            key = ("model." if prefix == "model.language_model." else "") + key[len(prefix):]
    return None if key.removeprefix("model.").startswith(SKIPPED_PREFIXES) else key


def _index_files(model_dir: Path) -> dict[str, tuple[Path, str]]:
    """Checkpoint key (normalized) -> (the safetensors file holding it, the key as stored there)."""
    if (index := model_dir / "model.safetensors.index.json").is_file():
        files = {k: model_dir / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    else:
        if not (shards := sorted(model_dir.glob("*.safetensors"))):
            raise CheckpointError(f"no *.safetensors files in {model_dir} (use load_format='dummy' for random weights)")
        files = {}
        for shard in shards:
            with safe_open(str(shard), "pt") as f:
                files.update({k: shard for k in f.keys()})
    if quantized := [k for k in files if k.endswith("weight_scale_inv")]:
        raise CheckpointError(f"quantized checkpoints are not supported (found {quantized[0]!r})")
    return {nk: (f, k) for k, f in files.items() if (nk := _normalize(k)) is not None}


def load_weights(model: MiniMaxM3Model, model_dir: Path) -> None:
    available = _index_files(model_dir)
    raw_name = {k: raw for k, (_, raw) in available.items()}
    open_file = cache(lambda path: safe_open(str(path), "pt"))  # (each file opened once, when first read)
    params, used, missing = dict(model.named_parameters()), set(), []
    for name, options in recipes(model.cfg).items():
        if (recipe := next((r for r in options if all(k in available for k, _ in r.keys)), None)) is None:
            if name.endswith("router_bias") and not model.cfg.use_routing_bias:
                continue  # no correction bias: the zeros it was built with stay
            absent = [k for k, _ in options[0].keys if k not in available]
            missing.append(f"{name} (needs {', '.join(absent[:4])}{' ...' if len(absent) > 4 else ''})")
            continue
        tensors = []
        for key, shape in recipe.keys:
            t = open_file(available[key][0]).get_tensor(raw_name[key])
            if tuple(t.shape) != shape:
                raise CheckpointError(f"tensor {raw_name[key]!r} has shape {list(t.shape)} but the config implies {list(shape)}")
            tensors.append(t)
            used.add(key)
        with torch.no_grad():
            params[name].copy_(recipe.combine(tensors).to(params[name].dtype))
    if missing:
        raise CheckpointError("checkpoint is missing tensors for: " + "; ".join(missing))
    if unexpected := sorted(raw_name[k] for k in available if k not in used):
        shown = ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
        raise CheckpointError(f"checkpoint has {len(unexpected)} unexpected tensors: {shown}")


def init_dummy_weights(model: MiniMaxM3Model, seed: int = 0) -> None:
    """Seeded random weights: matrices ~ N(0, 1/fan_in), norms at 1 (stored 0), router bias 0."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() < 2 or name.endswith("router_bias"):
                p.zero_()
                continue
            gain = 2.0 if name == "lm_head" else 1.0
            std = 1.0 if name.endswith("embed_tokens.weight") else gain / math.sqrt(p.shape[-1])
            p.copy_(torch.randn(p.shape, generator=gen) * std)


def load_model(model_path: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               load_format: str = "auto", seed: int = 0, cfg: ModelConfig | None = None) -> MiniMaxM3Model:
    """Build the model for `model_path` and fill its weights (`load_format`: auto | safetensors | dummy)."""
    cfg = cfg or load_config(model_path)
    model, model_dir = MiniMaxM3Model(cfg), Path(model_path)
    if load_format == "dummy" or (load_format == "auto" and not any(model_dir.glob("*.safetensors"))):
        logger.warning("loading DUMMY weights (seed %d) for %s: outputs are random, not a trained model",
                       seed, model_dir)
        init_dummy_weights(model, seed)
    elif load_format in ("auto", "safetensors"):
        load_weights(model, model_dir)
        logger.info("loaded weights from %s", model_dir)
    else:
        raise ValueError(f"load_format must be 'auto', 'safetensors' or 'dummy', got {load_format!r}")
    model.to(device)  # then cast to `dtype`, but the router and the norms (FP32_PARAMS); the RoPE table as the
    for name, p in model.named_parameters():  # model's math rounds it (layers.rope_rotation)
        if not name.endswith(FP32_PARAMS):
            p.data = p.data.to(dtype)
    model.rope_table = model.rope_table.to(dtype)
    return model.eval()
