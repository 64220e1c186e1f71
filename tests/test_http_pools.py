"""GET /pools, /pools/layers, /pools/layers/{id}, /pools/layers/{id}/buffers/{buffer} (http_api.md §6).

Two live servers: configs/tiny (all three layer kinds) and a transformers-native checkpoint
(`mixed_b4_gqa4`: its sparse layers are all K-only, so there is no index_kv_pool). Every expected
value is derived here from the raw config.json and model.md §5, not from the server's code.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.http_utils import generate, wait_pool_idle
from tests.server_utils import TINY, live_server

SIZE = 4096  # --max-total-tokens for both servers
FLOAT32 = 4
BUFFERS = ("key", "value", "index_key", "index_value")


def tiny_kinds(cfg: dict) -> list[str]:
    sc = cfg["sparse_attention_config"]
    return ["dense" if not s else ("sparse_k_only" if k else "sparse_index_kv")
            for s, k in zip(sc["sparse_attention_freq"], sc["sparse_disable_index_value"])]


def expected_layers(kinds: list[str], n_kv: int, d: int, d_i: int) -> list[dict]:
    """LayerInfo per layer, straight from §6 and model.md §5 (elements per token times 4 bytes)."""
    kv_ids = [i for i, k in enumerate(kinds) if k == "sparse_index_kv"]
    ko_ids = [i for i, k in enumerate(kinds) if k == "sparse_k_only"]
    main_shape, index_shape = [SIZE + 1, n_kv, d], [SIZE + 1, 1, d_i]
    out = []
    for i, kind in enumerate(kinds):
        main = {"pool": "main_pool", "local_layer_id": i}
        index = ({"pool": "index_kv_pool", "local_layer_id": kv_ids.index(i)} if kind == "sparse_index_kv" else
                 {"pool": "index_k_pool", "local_layer_id": ko_ids.index(i)} if kind == "sparse_k_only" else None)
        has_iv = kind == "sparse_index_kv"
        extra = {"dense": 0, "sparse_index_kv": 2 * d_i, "sparse_k_only": d_i}[kind]
        out.append({
            "layer_id": i, "attention": "dense" if kind == "dense" else "sparse", "kind": kind,
            "buffers": {"key": True, "value": True, "index_key": index is not None, "index_value": has_iv},
            "locations": {"key": main, "value": main, "index_key": index, "index_value": index if has_iv else None},
            "shapes": {"key": main_shape, "value": main_shape, "index_key": index_shape if index else None,
                       "index_value": index_shape if has_iv else None},
            "bytes_per_token": FLOAT32 * (2 * n_kv * d + extra),
        })
    return out


def expected_sub_pools(kinds: list[str], n_kv: int, d: int, d_i: int) -> list[dict]:
    rows = SIZE + 1
    pools = [{"name": "main_pool", "class": "MHATokenToKVPool", "layer_ids": list(range(len(kinds))),
              "head_num": n_kv, "head_dim": d, "has_key": True, "has_value": True,
              "bytes": rows * 2 * n_kv * d * FLOAT32 * len(kinds)}]
    kv = [i for i, k in enumerate(kinds) if k == "sparse_index_kv"]
    ko = [i for i, k in enumerate(kinds) if k == "sparse_k_only"]
    if kv:
        pools.append({"name": "index_kv_pool", "class": "MHATokenToKVPool", "layer_ids": kv, "head_num": 1,
                      "head_dim": d_i, "has_key": True, "has_value": True, "bytes": rows * 2 * d_i * FLOAT32 * len(kv)})
    if ko:
        pools.append({"name": "index_k_pool", "class": "MHATokenToKOnlyPool", "layer_ids": ko, "head_num": 1,
                      "head_dim": d_i, "has_key": True, "has_value": False, "bytes": rows * d_i * FLOAT32 * len(ko)})
    return pools


@pytest.fixture(scope="module")
def tiny():
    cfg = json.loads((Path(TINY) / "config.json").read_text())
    sc = cfg["sparse_attention_config"]
    geometry = (tiny_kinds(cfg), cfg["num_key_value_heads"], cfg["head_dim"], sc["sparse_index_dim"])
    with live_server("--max-total-tokens", str(SIZE)) as s, s.client() as c:
        yield c, geometry


@pytest.fixture(scope="module")
def native(tmp_path_factory):
    from tests.hf_models import build_hf_model  # imports transformers: only when this fixture runs

    path = tmp_path_factory.mktemp("mixed_b4_gqa4")
    build_hf_model("mixed_b4_gqa4", path)
    cfg = json.loads((path / "config.json").read_text())
    kinds = ["sparse_k_only" if t == "minimax_m3_sparse" else "dense" for t in cfg["layer_types"]]
    geometry = (kinds, cfg["num_key_value_heads"], cfg["head_dim"], cfg["index_head_dim"])
    with live_server("--model-path", str(path), "--skip-tokenizer-init", "--max-total-tokens", str(SIZE)) as s, \
            s.client() as c:
        yield c, geometry


@pytest.fixture(params=["tiny", "native"])
def served(request):
    return request.getfixturevalue(request.param)


def test_pools_summary_matches_the_config(served):
    client, (kinds, n_kv, d, d_i) = served
    pools = wait_pool_idle(client)
    layers = expected_layers(kinds, n_kv, d, d_i)
    per_token = sum(layer["bytes_per_token"] for layer in layers)
    assert {k: pools[k] for k in ("pool_class", "device", "dtype", "page_size", "size_tokens")} == {
        "pool_class": "MiniMaxSparseKVPool", "device": "cpu", "dtype": "float32", "page_size": 1, "size_tokens": SIZE}
    assert pools["used_tokens"] + pools["free_tokens"] == SIZE
    assert 0 <= pools["evictable_tokens"] <= pools["used_tokens"]
    assert pools["bytes_per_token"] == per_token
    assert pools["total_bytes"] == (SIZE + 1) * per_token == sum(p["bytes"] for p in pools["sub_pools"])
    assert pools["sub_pools"] == expected_sub_pools(kinds, n_kv, d, d_i)


def test_tiny_bytes_per_token_is_the_model_md_formula(tiny):
    client, _ = tiny
    # 2 dense (2*2*32) + 3 index-KV (2*2*32 + 2*32) + 3 K-only (2*2*32 + 32) elements, float32
    assert client.get("/pools").json()["bytes_per_token"] == 4 * (2 * 128 + 3 * 192 + 3 * 160) == 5248


def test_native_checkpoint_has_no_index_kv_pool(native):
    client, (kinds, *_) = native
    assert kinds == ["dense", "sparse_k_only", "dense", "sparse_k_only"]
    names = [p["name"] for p in client.get("/pools").json()["sub_pools"]]
    assert names == ["main_pool", "index_k_pool"]


def test_layers_match_the_config_layer_by_layer(served):
    client, geometry = served
    expected = expected_layers(*geometry)
    assert client.get("/pools/layers").json() == {"layers": expected}
    for info in expected:
        r = client.get(f"/pools/layers/{info['layer_id']}")
        assert r.status_code == 200 and r.json() == info


def test_unknown_and_malformed_layer_ids(served):
    client, (kinds, *_) = served
    last = len(kinds) - 1
    for bad in (99, len(kinds), -1):
        r = client.get(f"/pools/layers/{bad}")
        assert r.status_code == 404
        assert r.json() == {"error": {"message": f"layer_id {bad} does not exist; valid layer ids are 0..{last}"}}
        assert client.get(f"/pools/layers/{bad}/buffers/key").status_code == 404
    for bad in ("abc", "1.5"):
        r = client.get(f"/pools/layers/{bad}")
        assert r.status_code == 400 and "layer_id" in r.json()["error"]["message"]


def test_buffer_metadata_for_every_buffer_each_layer_has(served):
    client, geometry = served
    for info in expected_layers(*geometry):
        for buf in BUFFERS:
            r = client.get(f"/pools/layers/{info['layer_id']}/buffers/{buf}")
            if not info["buffers"][buf]:
                assert r.status_code == 409, (info["layer_id"], buf)
                continue
            body = r.json()
            shape, loc = info["shapes"][buf], info["locations"][buf]
            cls = "MHATokenToKOnlyPool" if loc["pool"] == "index_k_pool" else "MHATokenToKVPool"
            assert body == {"layer_id": info["layer_id"], "buffer": buf, "pool": loc["pool"], "pool_class": cls,
                            "local_layer_id": loc["local_layer_id"], "shape": shape, "dtype": "float32",
                            "bytes": shape[0] * shape[1] * shape[2] * FLOAT32}
            assert len(r.content) < 1000  # metadata only, never tensor contents


def test_index_value_of_a_k_only_layer_is_409_with_the_remedy(tiny, native):
    r = tiny[0].get("/pools/layers/3/buffers/index_value")
    assert r.status_code == 409
    assert r.json()["error"]["message"] == (
        "layer 3 is a score-only sparse layer (sparse_disable_index_value): its index K lives in "
        "MHATokenToKOnlyPool, which does not allocate V. Use buffer 'index_key' for the index keys; only "
        "layers [2, 4, 6] have 'index_value'.")
    dense = tiny[0].get("/pools/layers/0/buffers/index_key")
    assert dense.status_code == 409 and "dense layer" in dense.json()["error"]["message"]
    r = native[0].get("/pools/layers/1/buffers/index_value")
    assert r.status_code == 409
    msg = r.json()["error"]["message"]
    assert msg.startswith("layer 1 is a score-only sparse layer (sparse_disable_index_value)")
    assert msg.endswith("no layer of this model has 'index_value'.")


def test_unknown_buffer_name_is_400_listing_the_four_names(served):
    client, _ = served
    r = client.get("/pools/layers/0/buffers/query")
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "'query'" in msg and all(f"'{b}'" in msg for b in BUFFERS)


def test_used_tokens_follow_requests(served):
    client, (kinds, *_) = served
    client.post("/flush_cache")
    assert client.get("/pools").json()["used_tokens"] == 0
    res = generate(client, input_ids=[5, 6, 7, 8, 9, 10, 11, 12], sampling_params={"max_new_tokens": 5,
                                                                                   "ignore_eos": True})
    pools = wait_pool_idle(client)
    # the finished request's computed tokens (prompt + all outputs but the last) stay cached, unlocked
    assert pools["used_tokens"] == pools["evictable_tokens"] == 8 + res["meta_info"]["completion_tokens"] - 1
    assert pools["free_tokens"] == SIZE - pools["used_tokens"]


def test_native_server_generates_from_ids_without_text(native):
    client, _ = native
    res = generate(client, input_ids=[1, 2, 3, 4, 5], sampling_params={"max_new_tokens": 4, "temperature": 0})
    assert "text" not in res and len(res["output_ids"]) == 4 and all(0 <= t < 512 for t in res["output_ids"])
    assert client.post("/generate", json={"text": "hi"}).status_code == 400
