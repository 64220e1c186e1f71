"""Captured decode (inductor graphs per batch-size bucket) against the same step run eager, on configs/tiny
cut to three layers (one of each kind: dense, sparse with the index-value branch, sparse K-only; MoE; dummy
weights; a graph's compile time grows with its layer count), capturing buckets 1 and 4 (the batch-1 graph and
the dynamic one): greedy tokens equal and logits within 1e-5 at batch 1, 3 (padded to bucket 4) and 4, over
steps that cross a block boundary; decode after a prefix-cache hit; padding rows touch only the padding slot;
the saved graphs loaded by a second engine; warm-up keeps /health at 503. The transformers configurations
are in test_decode_graph_parity.py (a file of their own: `make test` runs files on two workers).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import torch
from engine_utils import TINY, make_engine, solo
from hf_models import build_hf_model

from engine.model.forward_batch import DecodeBatch
from engine.model.loader import load_model
from engine.runtime.cuda_graph import CudaGraphs
from engine.runtime.graph_passes import SUM_PIECE
from tests.forward_utils import PagedModel, assert_captured_equals_eager
from tests.server_utils import start_server

BUCKETS = [1, 4]  # NOTE: tiny3 runs with 4096 KV slots everywhere, so the graphs the first test compiles and
# saves are loaded by the others (the pool's shape is part of their key)


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory) -> Path:
    """configs/tiny's config and tokenizer with three layers, one of each kind (no weights: dummy)."""
    path = tmp_path_factory.mktemp("tiny3")
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(Path(TINY) / f, path / f)
    cfg = json.loads((Path(TINY) / "config.json").read_text())
    sparse = cfg["sparse_attention_config"]
    cfg.update(num_hidden_layers=3, moe_layer_freq=[0, 1, 1])
    sparse.update(sparse_attention_freq=[0, 1, 1], sparse_disable_index_value=[0, 0, 1])
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture(scope="module")
def paged(tiny3):
    return PagedModel(load_model(tiny3), size=4096, max_requests=64, graph_buckets=BUCKETS)


@pytest.mark.parametrize("rows", [1, 3, 4])
def test_captured_decode_equals_eager(paged, rows):
    assert_captured_equals_eager(paged, rows)


def test_one_graph_serves_every_key_length_and_grad_mode(tiny3):
    """After warm-up, each graph runs with grad on or off and at key lengths on both sides of 4096 (where
    inductor's CPU float sums change) within its guards, and matches eager there."""
    p = PagedModel(load_model(tiny3), size=4096, max_requests=64, graph_buckets=BUCKETS)
    for rows in (1, 4):
        for n, grad in ((320, True), (320, False), (1024, False), (4160, False), (8192, True)):
            keys = (torch.arange(rows * n) % 4000 + 1).view(rows, n)  # any slots: the pool's size bounds no row
            batch = DecodeBatch(torch.full((rows,), 5), torch.full((rows,), n - 1), torch.arange(rows) + 1, keys)
            with torch.set_grad_enabled(grad), torch.compiler.set_stance("fail_on_recompile"):
                captured = p.runner.graphs.run(batch)
            assert (captured - p.decode_step(batch)).abs().max().item() < 1e-5
    info = p.runner.graphs.info()
    assert info["guard_misses"] == info["eager_steps"] == info["compiles_since_warm_up"] == 0, info


def test_dense_only_model_through_the_batch_one_graph(tmp_path):
    """A model with no sparse layer (its decode keys start at two SUM_PIECEs, not at K + 1 blocks) compiles one
    batch-1 graph at warm-up that serves the shortest key length and longer ones, matching eager."""
    build_hf_model("all_dense", tmp_path)
    p = PagedModel(load_model(tmp_path), graph_buckets=[1])
    assert p.runner.min_keys == 2 * SUM_PIECE
    for n in (p.runner.min_keys, 1024 + SUM_PIECE):  # (decode key counts are whole pieces)
        batch = DecodeBatch(torch.tensor([5]), torch.tensor([n - 1]), torch.tensor([n]), torch.arange(n)[None] + 1)
        assert (p.runner.graphs.run(batch) - p.decode_step(batch)).abs().max().item() < 1e-5
    assert p.runner.graphs.info()["guard_misses"] == 0


def test_padding_rows_touch_only_the_padding_slot(tiny3):
    p = PagedModel(load_model(tiny3), size=4096, max_requests=64, graph_buckets=BUCKETS)
    kvs = [p.kv.admit([]) for _ in range(3)]
    p.step(kvs, [[5, 6, 7], [8, 9], [10, 11, 12, 13]])
    batch = p.decode_batch(kvs, [1, 2, 3])
    written = set(batch.out_cache_loc.tolist())
    before = [t.clone() for sub in p.pool.sub_pools() for t in sub.tensors()]
    p.runner.graphs.run(batch)  # 3 rows in bucket 4: one padding row
    after = [t for sub in p.pool.sub_pools() for t in sub.tensors()]
    for a, b in zip(before, after):
        changed = set((a != b).flatten(1).any(dim=1).nonzero().flatten().tolist())
        assert changed <= written | {0}, f"slots {changed - written - {0}} changed"
    assert p.kv.check_integrity()


def test_engine_with_graphs_matches_eager_after_a_prefix_hit(tiny3):
    graphs = make_engine(model_path=str(tiny3), cuda_graph_bs=BUCKETS, disable_cuda_graph=False)
    graphs.warm_up()
    eager = make_engine(model_path=str(tiny3), disable_radix_cache=True)
    shared = list(range(10, 150))
    params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    first = solo(graphs, shared + [7, 8], **params)
    hit = solo(graphs, shared + [9], **params)
    assert hit.cached_tokens >= 140 and first.cached_tokens == 0
    assert hit.output_ids == solo(eager, shared + [9], **params).output_ids
    assert graphs.check_integrity() and graphs.stats().captured_batch_sizes == tuple(BUCKETS)


def test_warm_up_keeps_health_at_503_then_reports_the_buckets(tmp_path, tiny3):
    srv = start_server("--cuda-graph-bs", "1", "4", "--model-path", str(tiny3), "--max-total-tokens", "4096",
                       log_dir=tmp_path, wait=0)
    try:
        saw_warming, deadline = False, time.monotonic() + 600
        while time.monotonic() < deadline:
            try:
                r = httpx.get(srv.url + "/health", timeout=2)
            except httpx.HTTPError:
                time.sleep(0.2)
                continue
            if r.status_code == 200:
                break
            saw_warming |= r.status_code == 503 and "warming up" in r.text
            time.sleep(0.2)
        assert saw_warming and r.status_code == 200
        info = httpx.get(srv.url + "/server_info", timeout=10).json()
        assert info["captured_decode_batch_sizes"] == [1, 4] and info["status"] == "ready"
        assert "batch 4 ready" in srv.logs() and "batch 1 ready" in srv.logs()
        out = httpx.post(srv.url + "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 4}},
                         timeout=60).json()
        assert out["meta_info"]["completion_tokens"] == 4
    finally:
        srv.terminate()




def test_the_compiled_graphs_take_the_cuda_captures_static_inputs(paged):
    """CUDA's captured step (`CudaGraphs`) hands its step leading views of one set of static buffers; with
    --enable-torch-compile that step is these compiled graphs, whose guards must take those views (a strided key
    table would fail them and run eager). Built on the CPU: the views, run through the CPU's graphs."""
    static = CudaGraphs(paged.decode_step, (1, 4), (320, 1024), torch.device("cpu"))
    for rows, n in ((1, 320), (4, 320), (4, 1024), (1, 1024)):
        batch = static.view(rows, n)
        for dst, src in zip((batch.input_ids, batch.positions, batch.out_cache_loc, batch.key_slots),
                            (torch.full((rows,), 5), torch.full((rows,), n - 1), torch.arange(rows) + 1,
                             (torch.arange(rows * n) % 4000 + 1).view(rows, n))):
            dst.copy_(src)
        with torch.compiler.set_stance("fail_on_recompile"):
            captured = paged.runner.graphs.run(batch)
        assert (captured - paged.decode_step(batch)).abs().max().item() < 1e-5
    info = paged.runner.graphs.info()
    assert info["guard_misses"] == info["eager_steps"] == 0 and info["compiled"], info


def test_an_eager_step_runs_at_the_graphs_key_width(tiny3, monkeypatch):
    """Where Triton's kernels serve (CUDA), a step past the graphs (or with none) runs eager at their one key width:
    the block kernel is built for its block count, once. The wider table's columns are padding, masked: same logits.
    Once Triton is off, at its own width."""
    from engine.runtime import decode_graph

    p, widths = PagedModel(load_model(tiny3), size=4096, max_requests=4), []
    step = decode_graph.decode_step
    monkeypatch.setattr(decode_graph, "decode_step", lambda m, pool, b: widths.append(b.key_slots.shape[1]) or step(m, pool, b))
    kvs = [p.kv.admit([]) for _ in range(3)]
    last = [int(x[-1].argmax()) for x in p.step(kvs, [[5 + i] * (300 + 7 * i) for i in range(3)])]
    batch = p.decode_batch(kvs, last)
    narrow = p.runner.graphs.run(batch)
    monkeypatch.setattr(p.runner.graphs, "_wide", 1024)
    monkeypatch.setattr(decode_graph, "triton_decode", SimpleNamespace(serves=lambda device: True))  # (here only)
    torch.testing.assert_close(p.runner.graphs.run(batch), narrow, rtol=0, atol=1e-5)
    monkeypatch.setattr(decode_graph, "triton_decode", SimpleNamespace(serves=lambda device: False))  # (a launch failed:
    p.runner.graphs.run(batch)  # the other forms would gather every padding key)
    assert widths == [batch.key_slots.shape[1], 1024, batch.key_slots.shape[1]] and batch.key_slots.shape[1] < 1024
