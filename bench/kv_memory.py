"""`kv_memory`: KV bytes per token by layer kind and in total from the pool's own accounting,
cross-checked with model.md §5; what the K-only sub-pool saves; tokens per GiB."""

from __future__ import annotations

from pathlib import Path

import torch

from bench.context import BenchContext
from engine.model.config_json import load_config
from mem_cache import MiniMaxSparseKVPool

GIB = 1 << 30
PROBE_SIZE = 64  # a real (small) pool, to check that allocated bytes follow the per-token figure


def _spec_elements(kind: str, n_kv: int, d: int, d_i: int) -> int:
    """model.md §5, written out independently of mem_cache."""
    return {"dense": 2 * n_kv * d, "sparse_index_kv": 2 * n_kv * d + 2 * d_i, "sparse_k_only": 2 * n_kv * d + d_i}[kind]


def _model(path: Path, dtype: torch.dtype) -> dict:
    cfg = load_config(path)
    kinds = list(cfg.layer_kinds)
    geo = (cfg.num_kv_heads, cfg.head_dim, cfg.index_head_dim)
    pool = MiniMaxSparseKVPool(PROBE_SIZE, dtype, kinds, *geo)
    by_kind = pool.bytes_per_token_by_kind()
    total = MiniMaxSparseKVPool.bytes_per_token_for(kinds, *geo, dtype)
    spec_by_kind = {k: _spec_elements(k, *geo) * dtype.itemsize for k in by_kind}
    spec_total = sum(_spec_elements(k, *geo) for k in kinds) * dtype.itemsize
    all_index_v = ["sparse_index_kv" if k == "sparse_k_only" else k for k in kinds]
    without_k_only = MiniMaxSparseKVPool.bytes_per_token_for(all_index_v, *geo, dtype)
    fits = MiniMaxSparseKVPool.size_for_budget(GIB, kinds, *geo, dtype)
    return {
        "layer_kinds": kinds,
        "layers_by_kind": {k: kinds.count(k) for k in by_kind},
        "bytes_per_token_per_layer": by_kind,
        "bytes_per_token_total": total,
        "spec_bytes_per_token_per_layer": spec_by_kind,
        "spec_bytes_per_token_total": spec_total,
        "matches_spec": by_kind == spec_by_kind and total == spec_total,
        "allocated_bytes_probe": pool.total_bytes(),
        "allocated_matches_accounting": pool.total_bytes() == (PROBE_SIZE + 1) * total,
        "bytes_per_token_if_every_sparse_layer_had_index_v": without_k_only,
        "k_only_saves_bytes_per_token": without_k_only - total,
        "k_only_saves_fraction": (without_k_only - total) / without_k_only,
        "tokens_per_gib": fits,
        "tokens_per_gib_if_every_sparse_layer_had_index_v":
            MiniMaxSparseKVPool.size_for_budget(GIB, all_index_v, *geo, dtype),
    }


def run(ctx: BenchContext) -> dict:
    models = {}
    for name, path in (("tiny", ctx.models.tiny), ("hf_copy", ctx.models.hf_copy)):
        for dtype in (torch.float32, torch.bfloat16):
            models[f"{name}/{str(dtype).removeprefix('torch.')}"] = _model(path, dtype)
    print("\n== kv_memory ==")
    for key, r in models.items():
        per = ", ".join(f"{k} {v} B" for k, v in r["bytes_per_token_per_layer"].items())
        print(f"  {key:20s} per layer: {per}; total {r['bytes_per_token_total']} B/token "
              f"(spec {'ok' if r['matches_spec'] else 'MISMATCH'}); K-only saves "
              f"{r['k_only_saves_bytes_per_token']} B/token ({100 * r['k_only_saves_fraction']:.1f}%); "
              f"{r['tokens_per_gib']:,} tokens per GiB")
    return {"models": models}
