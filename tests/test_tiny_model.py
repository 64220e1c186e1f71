"""The shipped default model, configs/tiny: its layer kinds, its pool layout and its byte accounting."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import pytest

from engine.config import load_config
from engine.llm import LLM
from engine.loader import load_model
from engine.model_runner import ModelRunner
from mem_cache import KOnlyPoolError

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny"


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(load_model(TINY), max_total_tokens=512, max_running_requests=4, context_len=512)


def test_config_has_all_three_kinds_and_moe():
    cfg = load_config(TINY)
    assert set(cfg.layer_kinds) == {"dense", "sparse_index_kv", "sparse_k_only"}
    assert any(cfg.moe_layers) and not all(cfg.moe_layers)
    assert cfg.eos_token_ids == (1, 4)


def test_parameter_count_and_dummy_log(caplog):
    with caplog.at_level(logging.WARNING):
        model = load_model(TINY)
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
    rows = pool.size + pool.page_size
    n_k_only = c.layer_kinds.count("sparse_k_only")
    assert pool.index_k_pool.total_bytes() == n_k_only * rows * c.index_head_dim * 4  # no V tensor at all
    assert pool.total_bytes() == rows * pool.bytes_per_token()


def test_random_alloc_free_keeps_integrity(runner):
    rng = random.Random(0)
    alloc, held = runner.allocator, []
    for _ in range(500):
        if held and (rng.random() < 0.45 or not alloc.can_alloc(40)):
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            held.append(alloc.alloc(rng.randint(1, 40)))
        assert alloc.check_integrity() and runner.pool.check_integrity()
        assert alloc.available_size() + sum(len(h) for h in held) == 512
    for h in held:
        alloc.free(h)
    assert alloc.available_size() == 512


def test_serves_text_out_of_the_box():
    llm = LLM(TINY, max_total_tokens=1024, max_running_requests=4)
    out = llm.generate(["Hello there", "Once upon a time"], {"max_new_tokens": 8, "ignore_eos": True, "temperature": 0})
    assert [len(o["output_ids"]) for o in out] == [8, 8] and all(isinstance(o["text"], str) for o in out)
    sampled = llm.generate(["Hello"] * 2, [{"max_new_tokens": 8, "temperature": 1.0, "sampling_seed": s, "ignore_eos": True}
                                          for s in (1, 1)])
    assert sampled[0]["output_ids"] == sampled[1]["output_ids"]
    assert llm.engine.check_integrity() and llm.engine.flush_cache()
    assert llm.runner.allocator.available_size() == 1024
