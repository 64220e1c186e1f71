"""config.json in both shapes, and checkpoints that must load or fail with a message naming the problem."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from orig_checkpoint import make_config, random_state_dict, write_checkpoint
from safetensors.torch import save_file
from test_parity_transformers import Ours, prompt_logits

from engine.model.config import ConfigError
from engine.model.config_json import config_from_dict, load_config
from engine.model.loader import CheckpointError, load_model


def test_original_shape_fields():
    cfg = config_from_dict(make_config())
    assert cfg.shape == "minimax"
    assert cfg.layer_kinds == ("dense", "sparse_index_kv", "sparse_k_only", "sparse_index_kv")
    assert cfg.moe_layers == (False, True, True, True)
    assert (cfg.block_size, cfg.topk_blocks, cfg.init_blocks, cfg.local_blocks) == (4, 3, 1, 1)
    assert cfg.rotary_dim == 8 and cfg.shared_intermediate_size == 24 and cfg.eos_token_ids == (1,)


def test_original_shape_aliases_and_defaults():
    raw = make_config()
    sc = raw["sparse_attention_config"]
    sc["sparse_disable_value"] = sc.pop("sparse_disable_index_value")
    del sc["sparse_init_block"], sc["sparse_local_block"]
    sc["sparse_init_tokens"], sc["sparse_local_tokens"] = 5, 3  # ceil(5/4)=2 init, ceil(3/4)+1=2 local
    raw["sparse_attention_config"]["sparse_topk_blocks"] = 4
    cfg = config_from_dict(raw)
    assert cfg.layer_kinds[2] == "sparse_k_only" and (cfg.init_blocks, cfg.local_blocks) == (2, 2)
    raw["sparse_attention_config"]["use_sparse_attention"] = False
    assert config_from_dict(raw).layer_kinds == ("dense",) * 4
    del raw["rotary_dim"]
    raw["partial_rotary_factor"] = 0.5
    assert config_from_dict(raw).rotary_dim == 8
    raw["n_shared_experts"] = 2
    assert config_from_dict(raw).shared_intermediate_size == 48


def test_native_shape_and_text_config_wrapper(caplog):
    native = {"model_type": "minimax_m3_vl_text", "vocab_size": 100, "hidden_size": 64, "num_hidden_layers": 3,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rotary_dim": 64,
              "layer_types": ["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
              "mlp_layer_types": ["dense", "sparse", "sparse"], "index_n_heads": 2, "index_head_dim": 16,
              "index_block_size": 8, "index_topk_blocks": 2, "index_local_blocks": 1,
              "rope_parameters": {"rope_type": "default", "rope_theta": 1000.0, "partial_rotary_factor": 0.5}}
    with caplog.at_level(logging.WARNING):
        cfg = config_from_dict(native)
    assert "rotary_dim=64" in caplog.text and cfg.rotary_dim == 8  # model.md §7.17
    assert cfg.shape == "transformers" and cfg.rope_theta == 1000.0
    assert cfg.layer_kinds == ("dense", "sparse_k_only", "sparse_k_only") and cfg.moe_layers == (False, True, True)
    wrapped = config_from_dict({"model_type": "minimax_m3_vl", "text_config": native, "vision_config": {}})
    assert dataclasses.replace(wrapped, model_type=cfg.model_type) == cfg
    wrapped_orig = config_from_dict({"model_type": "minimax_m3_vl", "text_config": make_config()})
    assert wrapped_orig.layer_kinds[1] == "sparse_index_kv"


@pytest.mark.parametrize("mutate,field", [
    (lambda c: c["sparse_attention_config"].update(sparse_num_index_heads=4), "sparse_num_index_heads"),
    (lambda c: c["sparse_attention_config"].update(sparse_local_block=0), "sparse_local_block"),
    (lambda c: c["sparse_attention_config"].update(sparse_score_type="lse"), "sparse_score_type"),
    (lambda c: c.update(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_scaling"),
    (lambda c: c.update(rope_parameters={"rope_type": "linear", "factor": 2.0}), "rope_parameters"),
    (lambda c: c["sparse_attention_config"].update(sparse_init_block=3), "sparse_topk_blocks"),
    (lambda c: c.update(num_key_value_heads=3), "num_key_value_heads"),
    (lambda c: c["sparse_attention_config"].update(sparse_index_dim=4), "sparse_index_dim"),
    (lambda c: c["sparse_attention_config"].update(sparse_attention_freq=[0, 1, 1, 1, 1]), "sparse_attention_freq"),
    (lambda c: c.update(attention_output_gate=True), "attention_output_gate"),
    (lambda c: c.update(swiglu_beta=2.0), "swiglu_beta"),
    (lambda c: c.update(rotary_dim=7), "rotary_dim"),
    (lambda c: c.update(hidden_size=None), "hidden_size"),
])
def test_bad_configs_name_the_field(mutate, field, tmp_path):
    raw = make_config()
    mutate(raw)
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=field):
        load_config(tmp_path)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    cfg = make_config()
    return cfg, random_state_dict(cfg, seed=1)


def test_bad_checkpoints_name_the_tensor(ckpt, tmp_path):
    cfg, sd = ckpt
    bad = dict(sd)
    bad["model.layers.2.self_attn.index_k_proj.weight"] = torch.zeros(3, 64)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.index_k_proj\.weight.*\[3, 64\].*\[16, 64\]"):
        load_model(write_checkpoint(tmp_path / "shape", cfg, bad))
    missing = {k: v for k, v in sd.items() if k != "model.layers.1.self_attn.index_v_proj.weight"}
    with pytest.raises(CheckpointError, match=r"missing.*model\.layers\.1\.self_attn\.index_v_proj\.weight"):
        load_model(write_checkpoint(tmp_path / "missing", cfg, missing))
    extra = dict(sd) | {"model.layers.2.self_attn.index_v_proj.weight": torch.zeros(16, 64)}
    with pytest.raises(CheckpointError, match=r"unexpected.*model\.layers\.2\.self_attn\.index_v_proj\.weight"):
        load_model(write_checkpoint(tmp_path / "extra", cfg, extra))
    quant = dict(sd) | {"model.layers.0.self_attn.q_proj.weight_scale_inv": torch.ones(1)}
    with pytest.raises(CheckpointError, match="quantized"):
        load_model(write_checkpoint(tmp_path / "quant", cfg, quant))


def test_sharded_prefixed_checkpoint_with_skipped_keys_loads_identically(ckpt, tmp_path):
    cfg, sd = ckpt
    plain = Ours(write_checkpoint(tmp_path / "plain", cfg, sd))
    d = tmp_path / "sharded"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "minimax_m3_vl", "text_config": cfg}))
    keys = sorted(sd)
    shards = {"model-00001-of-00002.safetensors": keys[: len(keys) // 2],
              "model-00002-of-00002.safetensors": keys[len(keys) // 2:]}
    weight_map = {}
    for fname, part in shards.items():
        tensors = {f"language_model.{k}": sd[k] for k in part}
        if fname.startswith("model-00002"):
            tensors |= {"mtp.0.proj.weight": torch.ones(2), "vision_tower.patch.weight": torch.ones(2),
                        "multi_modal_projector.linear.weight": torch.ones(2)}
        save_file(tensors, str(d / fname))
        weight_map |= {k: fname for k in tensors}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    sharded = Ours(d)
    ids = list(range(3, 40))
    assert torch.equal(prompt_logits(sharded, ids), prompt_logits(plain, ids))


def test_dummy_weights_are_seeded_and_announced(ckpt, tmp_path, caplog):
    cfg, sd = ckpt
    d = write_checkpoint(tmp_path / "d", cfg, sd)
    with caplog.at_level(logging.WARNING):
        a = load_model(d, load_format="dummy", seed=4)
    assert "DUMMY weights" in caplog.text
    b = load_model(d, load_format="dummy", seed=4)
    c = load_model(d, load_format="dummy", seed=5)
    assert torch.equal(a.lm_head, b.lm_head) and not torch.equal(a.lm_head, c.lm_head)
    with pytest.raises(ValueError, match="load_format"):
        load_model(d, load_format="pt")
