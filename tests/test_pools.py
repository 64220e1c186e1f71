"""mem_cache/: token pools, slot allocator and the MiniMax sparse KV pool (CPU, fast)."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
import torch

from mem_cache import (
    BUFFER_NAMES,
    KOnlyPoolError,
    LayerIdError,
    MHATokenToKOnlyPool,
    MHATokenToKVPool,
    MiniMaxSparseKVPool,
    MissingBufferError,
    PoolExhaustedError,
    ReqToTokenPool,
    TokenSlotAllocator,
)

KINDS = [
    "dense",
    "dense",
    "sparse_index_kv",
    "sparse_k_only",
    "sparse_index_kv",
    "sparse_k_only",
    "sparse_index_kv",
    "sparse_k_only",
]
H, D, DI = 2, 32, 32
SIZE = 64
ROWS = SIZE + 1  # row 0 is the padding slot


@pytest.fixture
def pool() -> MiniMaxSparseKVPool:
    return MiniMaxSparseKVPool(SIZE, torch.float32, KINDS, H, D, DI)


def all_tensors(p: MiniMaxSparseKVPool) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for sub in p.sub_pools():
        for i, t in enumerate(sub.k_buffer):
            out[f"{sub.name}.k{i}"] = t
        for i, t in enumerate(getattr(sub, "v_buffer", [])):
            out[f"{sub.name}.v{i}"] = t
    return out


def test_layer_kinds_buffers_and_locations(pool: MiniMaxSparseKVPool) -> None:
    assert pool.check_integrity()
    assert pool.num_layers == 8 and pool.size == SIZE and pool.page_size == 1
    expected_index = {2: ("index_kv_pool", 0), 3: ("index_k_pool", 0), 4: ("index_kv_pool", 1),
                      5: ("index_k_pool", 1), 6: ("index_kv_pool", 2), 7: ("index_k_pool", 2)}  # fmt: skip
    for layer, kind in enumerate(KINDS):
        info = pool.layer_info(layer)
        assert info["layer_id"] == layer and info["kind"] == kind == pool.layer_kind(layer)
        assert info["attention"] == ("dense" if kind == "dense" else "sparse")
        flags = {
            "key": True,
            "value": True,
            "index_key": kind != "dense",
            "index_value": kind == "sparse_index_kv",
        }
        assert info["buffers"] == flags
        assert {b: pool.has_buffer(layer, b) for b in BUFFER_NAMES} == flags
        assert pool.has_value_buffer(layer) is True
        assert pool.has_index_value_buffer(layer) is (kind == "sparse_index_kv")
        assert info["locations"]["key"] == {"pool": "main_pool", "local_layer_id": layer}
        assert info["locations"]["value"] == {"pool": "main_pool", "local_layer_id": layer}
        assert info["shapes"]["key"] == info["shapes"]["value"] == [ROWS, H, D]
        if layer in expected_index:
            name, local = expected_index[layer]
            assert info["locations"]["index_key"] == {"pool": name, "local_layer_id": local}
            assert info["shapes"]["index_key"] == [ROWS, 1, DI]
        else:
            assert info["locations"]["index_key"] is None and info["shapes"]["index_key"] is None
        if kind == "sparse_index_kv":
            assert info["locations"]["index_value"] == info["locations"]["index_key"]
        else:
            assert info["locations"]["index_value"] is None and info["shapes"]["index_value"] is None
    local = {i: pool.buffer_location(i, "index_key").local_layer_id for i in range(2, 8)}
    assert local == {2: 0, 4: 1, 6: 2, 3: 0, 5: 1, 7: 2}
    assert json.loads(json.dumps(pool.layers_info())) == pool.layers_info()
    assert pool.layer_info(3)["bytes_per_token"] == 640  # the http_api.md §6 example


def test_k_only_pool_error_names_layer_and_remedy(pool: MiniMaxSparseKVPool) -> None:
    sub = pool.index_k_pool
    assert isinstance(sub, MHATokenToKOnlyPool) and sub.has_value_buffer is False
    loc = torch.tensor([1])
    calls = {
        "get_value_buffer": lambda: sub.get_value_buffer(1),
        "get_kv_buffer": lambda: sub.get_kv_buffer(1),
        "set_kv_buffer": lambda: sub.set_kv_buffer(1, loc, torch.ones(1, 1, DI), torch.ones(1, 1, DI)),
    }
    for accessor, call in calls.items():
        with pytest.raises(KOnlyPoolError) as ei:
            call()
        assert isinstance(ei.value, NotImplementedError)
        msg = str(ei.value)
        assert accessor in msg and "global layer 5" in msg and "MHATokenToKOnlyPool" in msg
        assert "no V by design" in msg and "sparse_disable_index_value" in msg
        assert "get_key_buffer(1)" in msg and "get_index_k_buffer(5)" in msg
    with pytest.raises(LayerIdError):
        sub.get_value_buffer(3)  # out-of-range local id is reported as such, not as "no V"


def test_index_accessors_outside_their_group_raise_value_error(pool: MiniMaxSparseKVPool) -> None:
    with pytest.raises(ValueError, match=r"get_index_kv_buffer: layer 3 is sparse_k_only.*\[2, 4, 6\]") as ei:
        pool.get_index_kv_buffer(3)
    assert "get_index_k_buffer(3)" in str(ei.value)
    with pytest.raises(ValueError, match=r"get_index_k_buffer: layer 0 is dense.*\[2, 3, 4, 5, 6, 7\]"):
        pool.get_index_k_buffer(0)
    loc, k = torch.tensor([1]), torch.ones(1, 1, DI)
    for call in (
        lambda: pool.get_index_v_buffer(5),
        lambda: pool.set_index_kv_buffer(7, loc, k, k),
        lambda: pool.get_index_kv_buffer(1),
        lambda: pool.set_index_k_buffer(1, loc, k),
    ):
        with pytest.raises(ValueError, match=r"only layers \[2, "):
            call()
    with pytest.raises(LayerIdError, match=r"layer_id 8 does not exist; valid layer ids are 0\.\.7"):
        pool.get_key_buffer(8)
    with pytest.raises(ValueError, match="index_value"):
        pool.has_buffer(0, "index_v")


def test_buffer_info_and_missing_buffer(pool: MiniMaxSparseKVPool) -> None:
    info = pool.buffer_info(3, "index_key")
    assert info == {"layer_id": 3, "buffer": "index_key", "pool": "index_k_pool",
                    "pool_class": "MHATokenToKOnlyPool", "local_layer_id": 0, "shape": [ROWS, 1, DI],
                    "dtype": "float32", "bytes": ROWS * DI * 4}  # fmt: skip
    assert pool.buffer_info(6, "index_value")["pool_class"] == "MHATokenToKVPool"
    with pytest.raises(MissingBufferError) as ei:
        pool.buffer_info(3, "index_value")
    assert str(ei.value) == (
        "layer 3 is a score-only sparse layer (sparse_disable_index_value): its index K lives in "
        "MHATokenToKOnlyPool, which does not allocate V. Use buffer 'index_key' for the index keys; "
        "only layers [2, 4, 6] have 'index_value'."
    )
    assert isinstance(ei.value, LookupError) and ei.value.layer_id == 3 and ei.value.buffer == "index_value"
    with pytest.raises(
        MissingBufferError, match=r"layer 1 is a dense layer.*'key' and 'value'.*\[2, 3, 4, 5, 6, 7\]"
    ):
        pool.buffer_info(1, "index_key")
    subs = pool.sub_pools_info()
    assert [(s["name"], s["class"], s["layer_ids"], s["has_value"]) for s in subs] == [
        ("main_pool", "MHATokenToKVPool", list(range(8)), True),
        ("index_kv_pool", "MHATokenToKVPool", [2, 4, 6], True),
        ("index_k_pool", "MHATokenToKOnlyPool", [3, 5, 7], False),
    ]
    assert sum(s["bytes"] for s in subs) == pool.total_bytes()


def test_bytes_per_token_matches_model_md_formula(pool: MiniMaxSparseKVPool) -> None:
    per_kind = {"dense": 2 * H * D, "sparse_index_kv": 2 * H * D + 2 * DI, "sparse_k_only": 2 * H * D + DI}
    expected = 4 * sum(per_kind[k] for k in KINDS)
    assert expected == 5248
    assert pool.bytes_per_token() == expected
    assert MiniMaxSparseKVPool.bytes_per_token_for(KINDS, H, D, DI, torch.float32) == expected
    assert MiniMaxSparseKVPool.bytes_per_token_for(KINDS, H, D, DI, torch.bfloat16) == expected // 2
    assert pool.bytes_per_token_by_kind() == {k: 4 * v for k, v in per_kind.items()}
    assert pool.total_bytes() == ROWS * expected
    assert sum(p.bytes_per_token() for p in pool.sub_pools()) == expected


def test_k_only_sub_pool_holds_only_k(pool: MiniMaxSparseKVPool) -> None:
    sub = pool.index_k_pool
    assert sub is not None and not hasattr(sub, "v_buffer")
    assert sub.total_bytes() == ROWS * 1 * DI * 4 * 3
    assert sub.bytes_per_token() == 3 * DI * 4
    assert (
        pool.index_kv_pool is not None and pool.index_kv_pool.total_bytes() == 2 * ROWS * DI * 4 * 3
    )


def test_set_get_round_trips_touch_only_their_rows(pool: MiniMaxSparseKVPool) -> None:
    gen = torch.Generator().manual_seed(0)
    loc = torch.tensor([5, 1, 17])
    cases = [
        ("main_pool.k3", "main_pool.v3", lambda k, v: pool.set_kv_buffer(3, loc, k, v), (H, D)),
        (
            "index_kv_pool.k1",
            "index_kv_pool.v1",
            lambda k, v: pool.set_index_kv_buffer(4, loc, k, v),
            (1, DI),
        ),
        ("index_k_pool.k2", None, lambda k, v: pool.set_index_k_buffer(7, loc, k), (1, DI)),
        ("index_kv_pool.k2", None, lambda k, v: pool.set_index_k_buffer(6, loc, k), (1, DI)),
    ]
    for k_name, v_name, write, shape in cases:
        before = {n: t.clone() for n, t in all_tensors(pool).items()}
        k = torch.randn(len(loc), *shape, generator=gen, dtype=torch.float64)  # cast to pool dtype on write
        v = torch.randn(len(loc), *shape, generator=gen)
        write(k, v)
        expect = {k_name: k.float()} | ({v_name: v} if v_name else {})
        for name, t in all_tensors(pool).items():
            if name in expect:
                assert t.dtype == torch.float32 and torch.equal(t[loc], expect[name])
                others = torch.ones(ROWS, dtype=torch.bool)
                others[loc] = False
                assert torch.equal(t[others], before[name][others]), name
            else:
                assert torch.equal(t, before[name]), f"{name} changed by a write to {k_name}"
    assert torch.equal(pool.get_key_buffer(3)[loc], all_tensors(pool)["main_pool.k3"][loc])
    k6, v6 = pool.get_index_kv_buffer(4)
    assert k6 is pool.get_index_k_buffer(4) and v6 is pool.get_index_v_buffer(4)
    assert pool.get_index_k_buffer(7) is pool.index_k_pool.get_key_buffer(2)  # type: ignore[union-attr]
    assert pool.get_kv_buffer(3)[1] is pool.get_value_buffer(3)


def test_no_sparse_layers_means_no_index_pools() -> None:
    p = MiniMaxSparseKVPool(16, torch.float32, ["dense"] * 3, H, D, DI)
    assert p.index_kv_pool is None and p.index_k_pool is None and p.check_integrity()
    assert [s["name"] for s in p.sub_pools_info()] == ["main_pool"]
    assert not any(p.has_buffer(i, b) for i in range(3) for b in ("index_key", "index_value"))
    assert p.bytes_per_token() == 3 * 2 * H * D * 4 and p.bytes_per_token_by_kind() == {
        "dense": 2 * H * D * 4
    }
    with pytest.raises(ValueError, match="no layer of this model has an index key buffer"):
        p.get_index_k_buffer(0)
    with pytest.raises(MissingBufferError, match="no layer of this model has 'index_value'"):
        p.buffer_info(2, "index_value")


def test_size_for_budget() -> None:
    per_token = MiniMaxSparseKVPool.bytes_per_token_for(KINDS, H, D, DI, torch.float32)
    budget = 1000 * per_token + 123
    size = MiniMaxSparseKVPool.size_for_budget(budget, KINDS, H, D, DI, torch.float32)
    assert (size + 1) * per_token <= budget < (size + 2) * per_token
    assert MiniMaxSparseKVPool(size, torch.float32, KINDS, H, D, DI).total_bytes() <= budget
    assert MiniMaxSparseKVPool.size_for_budget(1000 * per_token, KINDS, H, D, DI, torch.float32) == 999
    with pytest.raises(ValueError, match="no usable slot"):
        MiniMaxSparseKVPool.size_for_budget(per_token, KINDS, H, D, DI, torch.float32)


def test_mha_pools_basics() -> None:
    kv = MHATokenToKVPool(8, torch.bfloat16, 2, 4, 3, name="p", global_layer_ids=[1, 4, 6])
    assert kv.buffer_shape == (9, 2, 4) and kv.has_value_buffer is True
    assert kv.bytes_per_token() == 3 * 2 * 2 * 4 * 2 and kv.total_bytes() == 9 * kv.bytes_per_token()
    kv.set_kv_buffer(2, torch.tensor([3]), torch.ones(1, 2, 4), torch.full((1, 8), 2.0))  # flat [n, H*D] ok
    assert kv.get_key_buffer(2).dtype == torch.bfloat16 and float(kv.get_value_buffer(2)[3].sum()) == 16.0
    with pytest.raises(ValueError, match="does not fit"):
        kv.set_kv_buffer(0, torch.tensor([3, 4]), torch.ones(1, 2, 4), torch.ones(1, 2, 4))
    with pytest.raises(ValueError, match="cache_v of shape"):  # (V refused: K not written either)
        kv.set_kv_buffer(1, torch.tensor([5]), torch.ones(1, 2, 4), torch.ones(3))
    assert not kv.get_key_buffer(1).any()
    with pytest.raises(LayerIdError, match=r"\[1, 4, 6\]"):
        kv.get_key_buffer(3)
    with pytest.raises(ValueError, match="global_layer_ids"):
        MHATokenToKOnlyPool(8, torch.float32, 1, 4, 2, global_layer_ids=[1])


def test_check_integrity_detects_corruption(pool: MiniMaxSparseKVPool) -> None:
    pool.index_k_pool.v_buffer = [torch.zeros(1)]  # type: ignore[union-attr]
    with pytest.raises(AssertionError, match="K-only pool holds V"):
        pool.check_integrity()
    del pool.index_k_pool.v_buffer  # type: ignore[union-attr]
    pool._routes[3]["index_value"] = pool._routes[2]["index_value"]
    with pytest.raises(AssertionError, match="layer 3"):
        pool.check_integrity()
    alloc = TokenSlotAllocator(8)
    alloc._free = torch.cat([alloc._free, alloc._free[:1]])
    with pytest.raises(AssertionError, match="duplicate"):
        alloc.check_integrity()


def test_allocator_random_alloc_free() -> None:
    size = 256
    alloc = TokenSlotAllocator(size)
    rng = random.Random(1234)
    live: list[torch.Tensor] = []
    owned = torch.zeros(size + 1, dtype=torch.bool)  # slots owned by live allocations
    for _ in range(3000):
        if live and (rng.random() < 0.45 or not alloc.can_alloc(1)):
            slots = live.pop(rng.randrange(len(live)))
            alloc.free(slots)
            owned[slots] = False
        else:
            n = rng.randint(0, 20)
            if not alloc.can_alloc(n):
                with pytest.raises(PoolExhaustedError, match="call can_alloc"):
                    alloc.alloc(n)
                continue
            slots = alloc.alloc(n)
            assert slots.dtype == torch.int64 and slots.numel() == n
            assert bool((slots >= 1).all()), "padding slot handed out"
            assert not bool(owned[slots].any()), "slot handed out twice"
            owned[slots] = True
            live.append(slots)
        assert alloc.check_integrity()
        assert alloc.available_size() + alloc.used_size() == size
        assert alloc.used_size() == int(owned.sum())
    victim = next(s for s in live if s.numel())
    alloc.free(victim)
    with pytest.raises(ValueError, match=f"slot {int(victim[0])}"):
        alloc.free(victim)
    with pytest.raises(ValueError, match="padding slot"):
        alloc.free(torch.tensor([0]))
    taken = alloc.alloc(1)
    with pytest.raises(ValueError, match="given twice"):
        alloc.free(torch.cat([taken, taken]))
    alloc.clear()
    assert alloc.available_size() == size and alloc.check_integrity()


def test_req_to_token_pool() -> None:
    rp = ReqToTokenPool(4, 16)
    assert rp.req_to_token.shape == (4, 16) and rp.req_to_token.dtype == torch.int32
    assert not bool(rp.req_to_token.any())
    a = [rp.alloc() for _ in range(3)]
    assert len(set(a)) == 3 and rp.available_size() == 1
    last = rp.alloc()
    with pytest.raises(PoolExhaustedError):
        rp.alloc()
    rp.free(last)
    rp.write([(a[1], 2, 3)], torch.tensor([7, 8, 9]))
    assert rp.req_to_token[a[1], :6].tolist() == [0, 0, 7, 8, 9, 0]
    rp.write([(a[2], 4, 2), (a[1], 5, 0), (a[0], 0, 1), (a[1], 6, 3)], torch.tensor([1, 2, 3, 4, 5, 6]))
    expect = {a[0]: [3] + [0] * 9, a[1]: [0, 0, 7, 8, 9, 0, 4, 5, 6, 0], a[2]: [0, 0, 0, 0, 1, 2, 0, 0, 0, 0]}
    assert {r: rp.req_to_token[r, :10].tolist() for r in a} == expect  # each part at its row and positions
    rp.write([(a[0], 1, 1), (a[2], 6, 1)], torch.tensor([10, 11]))
    rp.write([(a[0], 2, 1), (a[2], 7, 1)], torch.tensor([12, 13]), steady=True)  # the last index, one further
    assert rp.req_to_token[a[0], :3].tolist() == [3, 10, 12] and rp.req_to_token[a[2], 6:8].tolist() == [11, 13]
    with pytest.raises(ValueError, match="max_context_len"):
        rp.write([(a[1], 15, 2)], torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="2 slots for 3 positions"):
        rp.write([(a[1], 0, 3)], torch.tensor([1, 2]))
    rp.free(a[0])
    with pytest.raises(ValueError, match="double free"):
        rp.free(a[0])
    with pytest.raises(ValueError, match="out of range"):
        rp.free(9)
    assert rp.available_size() == 2 and rp.check_integrity()  # the failed frees changed nothing
    rng = random.Random(7)
    live = a[1:]
    for _ in range(2000):
        if live and (rng.random() < 0.5 or not rp.available_size()):
            rp.free(live.pop(rng.randrange(len(live))))
        else:
            live.append(rp.alloc())
        assert rp.check_integrity() and rp.available_size() == 4 - len(live)


def test_mem_cache_imports_no_engine_or_server() -> None:
    code = "import sys, mem_cache; print([m for m in sys.modules if m.split('.')[0] in ('engine', 'server')])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
