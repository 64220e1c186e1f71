"""A step compiled ahead of time and saved (engine/runtime/precompiled.py), on a small step of the same shape
as the decode step (a module, a pool-like object, a DecodeBatch): a second one loads the file and computes
the same numbers, a broken file is compiled again, a batch its guards refuse runs eager and is counted (each
time: the verdict kept per batch signature), and the file's name changes with what the graph depends on."""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

import torch
from engine_utils import TINY
from torch import nn

from engine.model.config_json import load_config
from engine.model.forward_batch import DecodeBatch
from engine.model.model import MiniMaxM3Model
from engine.runtime.precompiled import PrecompiledStep, graph_key
from mem_cache import MiniMaxSparseKVPool


class _Pool:
    def __init__(self) -> None:
        self.table = torch.randn(64, 8, generator=torch.Generator().manual_seed(1))


def _step(model: nn.Module, pool: _Pool, batch: DecodeBatch) -> torch.Tensor:
    keys = pool.table[batch.key_slots].sum(1)  # [B, 8]
    return model(keys + batch.positions[:, None].float()).softmax(-1)


def _mark(batch: DecodeBatch) -> DecodeBatch:
    torch._dynamo.mark_dynamic(batch.key_slots, 1)
    return batch


def _batch(keys: int, dtype: torch.dtype = torch.int64) -> DecodeBatch:
    z = torch.zeros(2, dtype=torch.int64)
    return DecodeBatch(z + 3, z + keys - 1, z, (torch.arange(2 * keys) % 64).view(2, keys).to(dtype))


def test_saved_loaded_broken_and_refused(tmp_path, caplog):
    model, pool, path = nn.Linear(8, 5).eval(), _Pool(), tmp_path / "step.bin"
    first = PrecompiledStep(_step, {}, path, _mark)
    assert not first.path.exists()
    assert first.prepare(model, pool, _batch(16)) == "compiled" and first.path.exists()
    second = PrecompiledStep(_step, {}, path, _mark)
    assert second.prepare(model, pool, _batch(16)) == "loaded"
    with torch.no_grad():
        for keys in (16, 40):  # (the key length is dynamic: one graph for both)
            want = _step(model, pool, _batch(keys))
            assert torch.allclose(first(model, pool, _batch(keys)), want, atol=1e-6)
            assert torch.allclose(second(model, pool, _batch(keys)), want, atol=1e-6)
        assert second.guard_misses == 0
        with caplog.at_level(logging.WARNING):
            refused = second(model, pool, _batch(16, torch.int32))  # (its guards hold int64 slots)
        assert torch.allclose(refused, _step(model, pool, _batch(16)), atol=1e-6)
        assert second.guard_misses == 1 and "fails the guards" in caplog.text
        # the guards' verdicts are kept per batch signature: a refused one stays refused, a new one is checked
        second(model, pool, _batch(16, torch.int32))
        assert second.guard_misses == 2
        assert torch.allclose(second(model, pool, _batch(24)), _step(model, pool, _batch(24)), atol=1e-6)
        assert second.guard_misses == 2
    with torch.enable_grad():  # (grad mode is guarded: compiled under no_grad)
        assert torch.allclose(second(model, pool, _batch(16)), _step(model, pool, _batch(16)), atol=1e-6)
    assert second.guard_misses == 3
    path.write_bytes(b"not a compiled function")
    with caplog.at_level(logging.WARNING):
        assert PrecompiledStep(_step, {}, path, _mark).prepare(model, pool, _batch(16)) == "compiled"
    assert "could not be loaded" in caplog.text


def test_the_key_follows_the_model_shape_and_the_pool_shape():
    cfg = load_config(TINY)
    model = MiniMaxM3Model(cfg)

    def pool(size: int) -> MiniMaxSparseKVPool:
        return MiniMaxSparseKVPool(size, torch.float32, list(cfg.layer_kinds), cfg.num_kv_heads, cfg.head_dim,
                                   cfg.index_head_dim, torch.device("cpu"))

    key = graph_key("one", model, pool(256))
    assert key == graph_key("one", model, pool(256))
    assert key != graph_key("many", model, pool(256)) and key != graph_key("one", model, pool(512))
    assert key != graph_key("one", model.to(torch.float64), pool(256))


def test_the_server_imports_no_compiler():
    """A start that compiles nothing (CUDA graphs over the eager step; --disable-cuda-graph) skips dynamo's and
    inductor's import (~0.5-0.9 s of a warm start): nothing the server imports pulls them in."""
    code = "import sys, server.app; print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[1])
    assert out.stdout.strip() == "[]", out.stdout
