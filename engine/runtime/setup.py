"""Build what an engine needs from EngineArgs: device and dtype, model, tokenizer, KV pool and manager."""

import hashlib
import logging
import os
import time
from pathlib import Path

import torch

from engine.kernels import build_all
from engine.model.config_json import load_config
from engine.model.loader import load_model
from engine.model.model import MiniMaxM3Model
from engine.runtime.engine_args import EngineArgs
from engine.runtime.tokenizer import Tokenizer
from mem_cache import HiCache, KVCacheManager, MiniMaxSparseKVPool

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CPU_KV_BYTES = 512 << 20


def choose_threads(requested: int, sample_s: float = 0.25) -> int:
    """torch's thread count for this process: `requested` when given, else torch's default less the cores that other
    processes keep busy (over half of `sample_s`, read from /proc/stat) at start, at least 1. NOTE: OpenMP threads wait
    for each other at every barrier, so one sharing its core with a busy neighbour stalls all: configs/tiny's batch-1
    step (2 threads, 2 cores) 2.2 ms quiet, 10.7 ms beside a spinning process, 3.1 ms at 1 thread (bench/neighbour.py).
    A later neighbour is not seen; a start beside one compiles CPU graphs for its thread count if none is saved."""
    default = torch.get_num_threads()
    if requested > 0 or default == 1:
        return requested or 1
    try:
        mine, before = {f"cpu{i}" for i in os.sched_getaffinity(0)}, _cpu_times()  # (mine: the CPUs it may run on)
        time.sleep(sample_s)
        after = {cpu: t for cpu, t in _cpu_times().items() if cpu in mine and cpu in before}
    except (OSError, AttributeError):  # (no /proc/stat or affinity: not Linux)
        return default
    busy = sum(1 for cpu, (idle, total) in after.items()
               if total > before[cpu][1] and 1 - (idle - before[cpu][0]) / (total - before[cpu][1]) > 0.5)
    return max(1, min(default, len(after) - busy))


def _cpu_times() -> dict[str, tuple[int, int]]:
    """Per CPU: (idle + iowait, all) jiffies since boot."""
    rows = [line.split() for line in Path("/proc/stat").read_text().splitlines()]
    return {name: (int(ticks[3]) + int(ticks[4]), sum(map(int, ticks[:8])))
            for name, *ticks in rows if name.startswith("cpu") and name != "cpu"}


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
    if (budget := args.kv_cache_bytes) is None and device.type == "cuda":
        budget = int(torch.cuda.mem_get_info(device)[0] * args.mem_fraction_static)
    budget, c = budget or CPU_KV_BYTES, model.cfg
    return MiniMaxSparseKVPool.size_for_budget(budget, list(c.layer_kinds), c.num_kv_heads, c.head_dim,
                                               c.index_head_dim, dtype)


def model_fingerprint(model: MiniMaxM3Model, model_path: str, dtype: torch.dtype) -> str:
    """The disk tier's model identity: config.json, the dtype, and every weight's name, shape, first and last values."""
    h = hashlib.sha256(Path(model_path, "config.json").read_bytes() + str(dtype).encode())
    for name, t in model.state_dict().items():
        flat = t.detach().reshape(-1)
        h.update(f"{name}{tuple(t.shape)}".encode() + torch.cat([flat[:8], flat[-8:]]).float().cpu().numpy().tobytes())
    return h.hexdigest()


def _available_bytes() -> int | None:
    try:
        line = next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


def build_hicache(args: EngineArgs, model: MiniMaxM3Model, pool: MiniMaxSparseKVPool) -> HiCache | None:
    """The host tier (--hicache-size GB, else --hicache-ratio x the device pool) and the disk one, if asked."""
    if not args.enable_hierarchical_cache:
        return None
    per_token, free = pool.bytes_per_token(), _available_bytes()
    size = int(args.hicache_size * 1e9) // per_token - 1 if args.hicache_size else int(pool.size * args.hicache_ratio)
    if size < 1:
        raise ValueError(f"a host tier of {args.hicache_size} GB holds no token: one costs {per_token} bytes")
    if free is not None and (size + 1) * per_token > free // 2:  # (half of what is free: the process needs the rest)
        if args.hicache_size:
            raise ValueError(f"--hicache-size {args.hicache_size} GB is more than half the {free / 1e9:.1f} GB of "
                             "memory available; give a smaller --hicache-size")
        size = free // 2 // per_token - 1
        logger.warning("host KV tier: --hicache-ratio %.1f would take more than half the %.1f GB of memory available; "
                       "capped at %d tokens", args.hicache_ratio, free / 1e9, size)
    disk = args.hicache_storage_dir if args.hicache_storage_backend == "file" else None
    fingerprint = model_fingerprint(model, args.model_path, pool.dtype) if disk else ""
    logger.info("host KV tier: %d tokens (%.1f MiB, %s)%s", size, size * per_token / 2**20, args.hicache_write_policy,
                f", disk pages in {disk}" if disk else "")
    return HiCache(pool, size, args.hicache_write_policy, disk, fingerprint)


def build_components(args: EngineArgs
                     ) -> tuple[MiniMaxM3Model, Tokenizer | None, MiniMaxSparseKVPool, KVCacheManager, int]:
    """(model, tokenizer, KV pool, KV cache manager, context length)."""
    auto = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(auto if args.device in (None, "auto") else args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was given but CUDA is not available")
    if device.type == "cpu":  # (the C kernels, CPU-only, built or found in the cache now: not in a first request)
        if (threads := choose_threads(args.num_threads)) != torch.get_num_threads():
            logger.info("%d CPU threads (%s)", threads, "--num-threads" if args.num_threads else
                        f"{torch.get_num_threads() - threads} of {torch.get_num_threads()} cores busy at start")
            torch.set_num_threads(threads)
        build_all()
    if args.dtype != "auto" and args.dtype not in DTYPES:
        raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {args.dtype!r}")
    dtype = DTYPES.get(args.dtype, torch.bfloat16 if device.type == "cuda" else torch.float32)  # (CPUs: no fast bf16)
    cfg, tokenizer = load_config(args.model_path), load_tokenizer(args)
    if (args.context_length or 0) > cfg.max_position_embeddings:  # (past it, no rotation: model.rope_table)
        raise ValueError(f"context_length {args.context_length} is longer than the model's max_position_embeddings "
                         f"({cfg.max_position_embeddings})")
    model = load_model(args.model_path, dtype, device, args.load_format, args.random_seed, cfg=cfg)
    context_len, size = args.context_length or cfg.max_position_embeddings, kv_pool_tokens(args, model, dtype, device)
    pool = MiniMaxSparseKVPool(size, dtype, cfg.layer_kinds, cfg.num_kv_heads, cfg.head_dim, cfg.index_head_dim, device)
    kv = KVCacheManager(size, args.max_running_requests, context_len, device, args.disable_radix_cache,
                        build_hicache(args, model, pool))
    logger.info("model %s on %s/%s: %d layers %s, KV pool %d tokens (%.1f MiB)", args.model_path, device,
                str(dtype).removeprefix("torch."), cfg.num_layers, cfg.layer_kinds, size, pool.total_bytes() / 2**20)
    return model, tokenizer, pool, kv, context_len
