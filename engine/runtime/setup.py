"""Build what an engine needs from EngineArgs: device and dtype, model, tokenizer, KV pool and manager."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from engine.kernels import build_all
from engine.model.config_json import load_config
from engine.model.loader import load_model
from engine.model.model import MiniMaxM3Model
from engine.runtime.engine_args import EngineArgs
from engine.runtime.tokenizer import Tokenizer
from mem_cache import KVCacheManager, MiniMaxSparseKVPool

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_BYTES = 512 << 20


def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but CUDA is not available")
    return dev


def load_tokenizer(args: EngineArgs) -> Tokenizer | None:
    if args.skip_tokenizer_init:
        return None
    path = Path(args.tokenizer_path or args.model_path)
    if not (path / "tokenizer.json").is_file():
        raise ValueError(f"no tokenizer.json in {path}: pass --tokenizer-path DIR, or --skip-tokenizer-init "
                         "to send and receive token ids only")
    return Tokenizer.from_dir(path)


def kv_pool_tokens(args: EngineArgs, model: MiniMaxM3Model, dtype: torch.dtype, device: torch.device) -> int:
    """KV pool size in tokens: --max-total-tokens, else the byte budget divided by bytes per token."""
    if args.max_total_tokens is not None:
        return args.max_total_tokens
    budget = args.kv_cache_bytes
    if budget is None and device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = int(free * args.mem_fraction_static)
    budget = budget or CPU_KV_BYTES
    c = model.cfg
    return MiniMaxSparseKVPool.size_for_budget(budget, list(c.layer_kinds), c.num_kv_heads, c.head_dim,
                                               c.index_head_dim, dtype)


def build_components(args: EngineArgs
                     ) -> tuple[MiniMaxM3Model, Tokenizer | None, MiniMaxSparseKVPool, KVCacheManager, int]:
    """(model, tokenizer, KV pool, KV cache manager, context length)."""
    device = resolve_device(args.device)
    if device.type == "cpu":  # (the C kernels, CPU-only, built or found in the cache now: not in a first request)
        build_all()
    if args.dtype != "auto" and args.dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {args.dtype!r}")
    auto = torch.bfloat16 if device.type == "cuda" else torch.float32  # NOTE: CPUs have no fast bf16
    dtype = DTYPES.get(args.dtype, auto)
    cfg = load_config(args.model_path)
    tokenizer = load_tokenizer(args)
    model = load_model(args.model_path, dtype, device, args.load_format, args.random_seed, cfg=cfg)
    context_len = args.context_length or cfg.max_position_embeddings
    size = kv_pool_tokens(args, model, dtype, device)
    pool = MiniMaxSparseKVPool(size, dtype, list(cfg.layer_kinds), cfg.num_kv_heads, cfg.head_dim,
                               cfg.index_head_dim, device)
    kv = KVCacheManager(size, args.max_running_requests, context_len, device, args.disable_radix_cache)
    logger.info("model %s on %s/%s: %d layers %s, KV pool %d tokens (%.1f MiB)", args.model_path, device,
                str(dtype).removeprefix("torch."), cfg.num_layers, cfg.layer_kinds, size, pool.total_bytes() / 2**20)
    return model, tokenizer, pool, kv, context_len
