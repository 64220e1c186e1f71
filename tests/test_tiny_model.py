"""The shipped default model, configs/tiny: its layer kinds, its pool layout and its byte accounting."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest
import torch

from engine.model.config_json import load_config
from engine.model.loader import load_model
from engine.runtime.llm import LLM
from mem_cache import KOnlyPoolError, KVCacheManager, MiniMaxSparseKVPool

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny"


class Pools:
    def __init__(self) -> None:
        self.cfg = c = load_config(TINY)
        self.pool = MiniMaxSparseKVPool(512, torch.float32, list(c.layer_kinds), c.num_kv_heads, c.head_dim,
                                        c.index_head_dim)


@pytest.fixture(scope="module")
def runner():
    return Pools()


def test_config_has_all_three_kinds_and_moe():
    cfg = load_config(TINY)
    assert set(cfg.layer_kinds) == {"dense", "sparse_index_kv", "sparse_k_only"}
    assert any(cfg.moe_layers) and not all(cfg.moe_layers)
    assert cfg.eos_token_ids == (1, 4)


def test_parameter_count_and_dummy_log(caplog):
    with caplog.at_level(logging.WARNING):
        model = load_model(TINY, load_format="dummy")
    assert "DUMMY weights" in caplog.text
    n = sum(p.numel() for p in model.parameters())
    assert 10e6 <= n <= 20e6, n


def test_layer_flags_follow_the_config(runner):
    cfg, pool = runner.cfg, runner.pool
    for layer, kind in enumerate(cfg.layer_kinds):
        info = pool.layer_info(layer)
        assert info["kind"] == kind
        assert info["buffers"] == {"key": True, "value": True, "index_key": kind != "dense",
                                   "index_value": kind == "sparse_index_kv"}


def test_k_only_error_and_value_errors(runner):
    cfg, pool = runner.cfg, runner.pool
    k_only = [i for i, k in enumerate(cfg.layer_kinds) if k == "sparse_k_only"]
    index_kv = [i for i, k in enumerate(cfg.layer_kinds) if k == "sparse_index_kv"]
    sparse = sorted(k_only + index_kv)
    dense = [i for i, k in enumerate(cfg.layer_kinds) if k == "dense"]
    with pytest.raises(KOnlyPoolError) as e:
        pool.index_k_pool.get_value_buffer(0)
    assert isinstance(e.value, NotImplementedError)
    msg = str(e.value)
    assert f"layer {k_only[0]}" in msg and "by design" in msg and "get_index_k_buffer" in msg
    with pytest.raises(ValueError, match=str(index_kv).replace("[", r"\[").replace("]", r"\]")):
        pool.get_index_kv_buffer(k_only[0])
    with pytest.raises(ValueError, match=str(sparse).replace("[", r"\[").replace("]", r"\]")):
        pool.get_index_k_buffer(dense[0])


def test_bytes_per_token_equal_model_md(runner):
    c, pool = runner.cfg, runner.pool
    per_kind = {"dense": 2 * c.num_kv_heads * c.head_dim,
                "sparse_index_kv": 2 * c.num_kv_heads * c.head_dim + 2 * c.index_head_dim,
                "sparse_k_only": 2 * c.num_kv_heads * c.head_dim + c.index_head_dim}
    assert pool.bytes_per_token() == 4 * sum(per_kind[k] for k in c.layer_kinds)
    assert pool.bytes_per_token_by_kind() == {k: 4 * v for k, v in per_kind.items()}
    rows = pool.size + 1
    n_k_only = c.layer_kinds.count("sparse_k_only")
    assert pool.index_k_pool.total_bytes() == n_k_only * rows * c.index_head_dim * 4  # no V tensor at all
    assert pool.total_bytes() == rows * pool.bytes_per_token()


def test_random_admit_allocate_release_keeps_integrity(runner):
    rng = random.Random(0)
    kv, held = KVCacheManager(512, 8, 512), []
    for _ in range(500):
        if held and (rng.random() < 0.45 or not kv.can_admit() or not kv.can_allocate(40)):
            r = held.pop(rng.randrange(len(held)))
            kv.release(r, [7] * r.num_computed)  # identical token ids: the prefix cache dedups them
        else:
            r = kv.admit([])
            kv.allocate([(r, rng.randint(1, 40))])
            held.append(r)
        assert kv.check_integrity() and runner.pool.check_integrity()
        assert kv.free_slots() + kv.cached_slots() + sum(r.num_computed - r.cached for r in held) == 512
    for r in held:
        kv.release(r, [7] * r.num_computed)
    assert kv.flush() and kv.free_slots() == 512


def test_serves_text_out_of_the_box():
    llm = LLM(TINY, max_total_tokens=1024, max_running_requests=4, disable_cuda_graph=True)
    out = llm.generate(["Hello there", "Once upon a time"], {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0})
    assert [len(o["output_ids"]) for o in out] == [8, 8] and all(isinstance(o["text"], str) for o in out)
    sampled = llm.generate(["Hello"] * 2, [{"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": s, "ignore_eos": True}
                                          for s in (1, 1)])
    assert sampled[0]["output_ids"] == sampled[1]["output_ids"]
    assert llm.engine.check_integrity() and llm.engine.flush_cache()
    assert llm.engine.stats().free_tokens == 1024


def test_a_step_that_raises_leaves_the_llm_usable(monkeypatch):
    """A failed step ends the call's requests (their KV freed, not cached), so the next call runs as on a fresh LLM."""
    llm = LLM(TINY, max_total_tokens=1024, max_running_requests=4, disable_cuda_graph=True)
    params = {"max_new_tokens": 6, "ignore_eos": True, "temperature": 0}
    want = llm.generate(["Hello there", "Once upon a time"], params)
    assert llm.engine.flush_cache()
    forward, calls = llm.engine._runner.forward, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 3:  # (a decode step, the prompts' KV written)
            raise RuntimeError("a kernel failed")
        return forward(*args)

    monkeypatch.setattr(llm.engine._runner, "forward", failing)
    with pytest.raises(RuntimeError, match="a kernel failed"):
        llm.generate(["Hello there", "Once upon a time"], params)
    assert llm.engine.check_integrity() and llm.engine.stats().num_running == 0
    assert [o["output_ids"] for o in llm.generate(["Hello there", "Once upon a time"], params)] == \
        [o["output_ids"] for o in want]
    assert llm.engine.flush_cache() and llm.engine.stats().free_tokens == 1024
