"""config.json -> ModelConfig, from either shape (model.md §1), maybe inside a multimodal config's `text_config`: the
original MiniMax shape (a `sparse_attention_config` dict and `moe_layer_freq`) or the transformers-native one
(`model_type: minimax_m3_vl_text`: flat `index_*` keys, `layer_types`, `mlp_layer_types` and `rope_parameters`)."""

import json
import logging
import math
from pathlib import Path
from typing import Any

from engine.model.config import ConfigError, ModelConfig, _require

logger = logging.getLogger(__name__)
NATIVE_MODEL_TYPE = "minimax_m3_vl_text"


def _get(d: dict[str, Any], key: str, default: Any) -> Any:
    v = d.get(key, default)
    return default if v is None else v


def _check_equal(d: dict[str, Any], **allowed: tuple[Any, ...]) -> None:
    """Each field named, when set (not null), must hold one of its allowed values."""
    for field, values in allowed.items():
        value = _get(d, field, values[0])
        _require(value in values, field, f"only {' or '.join(repr(a) for a in values)} is supported, got {value!r}")


def _per_layer_flags(d: dict[str, Any], field: str, n: int) -> list[bool]:
    raw = d.get(field) or []
    _require(isinstance(raw, list), field, f"must be a list, got {type(raw).__name__}")
    _require(len(raw) <= n, field, f"has {len(raw)} entries but the model has {n} layers")
    return [bool(raw[i]) if i < len(raw) else False for i in range(n)]


def _rope(d: dict[str, Any], shape: str, head_dim: int) -> tuple[float, int]:
    rp = d.get("rope_parameters") or {}
    for field, params in (("rope_scaling", d.get("rope_scaling") or {}), ("rope_parameters", rp)):
        _require(isinstance(params, dict), field, f"must be an object, got {params!r}")
        kind = params.get("rope_type", params.get("type", "default"))
        _require(kind in ("default", None), f"{field}.rope_type",
                 f"only plain RoPE is supported, got scaling type {kind!r}")
    theta = float(_get(rp, "rope_theta", _get(d, "rope_theta", 5e6)))
    if shape == "transformers":
        factor = float(_get(rp, "partial_rotary_factor", 1.0))
        rotary = int(head_dim * factor)
        if "rotary_dim" in d and d["rotary_dim"] != rotary:
            logger.warning("config.json has rotary_dim=%s but transformers sizes RoPE from "
                           "rope_parameters.partial_rotary_factor (%s x head_dim %s = %s); using %s",
                           d["rotary_dim"], factor, head_dim, rotary, rotary)
        return theta, rotary
    factor = d.get("partial_rotary_factor", rp.get("partial_rotary_factor"))
    if d.get("rotary_dim") is not None:
        rotary = int(d["rotary_dim"])
        if factor is not None and int(head_dim * float(factor)) != rotary:
            logger.warning("config.json has rotary_dim=%s and partial_rotary_factor=%s (head_dim %s): "
                           "they disagree; using rotary_dim=%s", rotary, factor, head_dim, rotary)
    else:
        rotary = int(head_dim * float(1.0 if factor is None else factor))
    return theta, rotary


def _sparse_fields(d: dict[str, Any], shape: str, n: int) -> dict[str, Any]:
    """Layer kinds and indexer hyper-parameters from either shape."""
    if shape == "transformers":
        types = d.get("layer_types") or ["full_attention"] * n
        _require(isinstance(types, list) and len(types) <= n, "layer_types", f"a list of at most {n} entries")
        for t in types:
            _require(t in ("full_attention", "minimax_m3_sparse"), "layer_types",
                     f"entries must be 'full_attention' or 'minimax_m3_sparse', got {t!r}")
        # transformers has no index-value branch: every sparse layer is score-only (K-only).
        kinds = ["sparse_k_only" if i < len(types) and types[i] == "minimax_m3_sparse" else "dense" for i in range(n)]
        return dict(layer_kinds=tuple(kinds), index_head_dim=int(_get(d, "index_head_dim", 128)),
                    index_num_heads=int(_get(d, "index_n_heads", 4)), block_size=int(_get(d, "index_block_size", 128)),
                    topk_blocks=int(_get(d, "index_topk_blocks", 16)), init_blocks=int(_get(d, "index_init_blocks", 0)),
                    local_blocks=int(_get(d, "index_local_blocks", 1)))
    sc = d.get("sparse_attention_config") or {}
    _require(isinstance(sc, dict), "sparse_attention_config", "must be an object")
    enabled = bool(sc.get("use_sparse_attention", False))
    sparse = _per_layer_flags(sc, "sparse_attention_freq", n) if enabled else [False] * n
    key = "sparse_disable_index_value" if "sparse_disable_index_value" in sc else "sparse_disable_value"
    k_only = _per_layer_flags(sc, key, n)
    if enabled:
        _check_equal(sc, sparse_score_type=("max",))
    block = int(_get(sc, "sparse_block_size", 128))
    if (init := sc.get("sparse_init_block")) is None and sc.get("sparse_init_tokens") is not None:
        init = math.ceil(int(sc["sparse_init_tokens"]) / block)
    if (local := sc.get("sparse_local_block")) is None and sc.get("sparse_local_tokens") is not None:
        local = math.ceil(int(sc["sparse_local_tokens"]) / block) + 1
    kinds = ["dense" if not s else ("sparse_k_only" if ko else "sparse_index_kv") for s, ko in zip(sparse, k_only)]
    return dict(layer_kinds=tuple(kinds), index_num_heads=int(_get(sc, "sparse_num_index_heads", 4)),
                index_head_dim=int(_get(sc, "sparse_index_dim", 128)),
                block_size=block, topk_blocks=int(_get(sc, "sparse_topk_blocks", 16)),
                init_blocks=int(0 if init is None else init), local_blocks=int(1 if local is None else local))


def _moe_layers(d: dict[str, Any], shape: str, n: int) -> tuple[bool, ...]:
    if shape == "transformers":
        types = d.get("mlp_layer_types") or ["sparse"] * n
        _require(isinstance(types, list) and len(types) <= n, "mlp_layer_types", f"a list of at most {n} entries")
        for t in types:
            _require(t in ("sparse", "dense"), "mlp_layer_types", f"entries must be 'sparse' or 'dense', got {t!r}")
        return tuple(i < len(types) and types[i] == "sparse" for i in range(n))
    if (freq := d.get("moe_layer_freq")) is None:
        return (True,) * n
    if isinstance(freq, int):  # an integer frequency: every freq-th layer is MoE
        _require(freq >= 1, "moe_layer_freq", f"must be >= 1, got {freq}")
        return tuple((i + 1) % freq == 0 for i in range(n))
    return tuple(_per_layer_flags(d, "moe_layer_freq", n))


def config_from_dict(raw: dict[str, Any]) -> ModelConfig:
    if not isinstance(raw, dict):
        raise ConfigError("config.json must hold a JSON object")
    d = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else raw
    native_keys = ("layer_types", "mlp_layer_types", "index_n_heads", "index_head_dim", "index_block_size")
    shape = "transformers" if d.get("model_type") == NATIVE_MODEL_TYPE or (
        "sparse_attention_config" not in d and any(k in d for k in native_keys)) else "minimax"
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"):
        _require(isinstance(d.get(key), int) and d[key] > 0, key, f"required positive integer, got {d.get(key)!r}")
    n, hidden, n_q = d["num_hidden_layers"], d["hidden_size"], d["num_attention_heads"]
    n_kv, head_dim = int(_get(d, "num_key_value_heads", n_q)), int(_get(d, "head_dim", hidden // n_q))
    acts = ("swigluoai", "silu") if shape == "transformers" else ("swigluoai",)
    _check_equal(d, use_gemma_norm=(True,), qk_norm_type=("per_head",), use_qk_norm=(True,),
                 attention_output_gate=(False,), hidden_act=acts, swiglu_beta=(1, 1.0), scoring_func=("sigmoid",))
    theta, rotary = _rope(d, shape, head_dim)
    shared = int(_get(d, "shared_intermediate_size", 3072)) * int(_get(d, "n_shared_experts", 1))
    eos = d.get("eos_token_id", raw.get("eos_token_id"))
    return ModelConfig(  # (in the fields' order)
        vocab_size=d["vocab_size"], hidden_size=hidden, num_layers=n, num_heads=n_q, num_kv_heads=n_kv,
        head_dim=head_dim, rotary_dim=rotary, rope_theta=theta,
        max_position_embeddings=int(_get(d, "max_position_embeddings", 524288)),
        rms_norm_eps=float(_get(d, "rms_norm_eps", 1e-6)), intermediate_size=int(_get(d, "intermediate_size", 3072)),
        dense_intermediate_size=int(_get(d, "dense_intermediate_size", 12288)), shared_intermediate_size=shared,
        num_experts=int(_get(d, "num_local_experts", _get(d, "num_experts", 128))),
        num_experts_per_tok=int(_get(d, "num_experts_per_tok", 4)),
        routed_scaling_factor=float(_get(d, "routed_scaling_factor", 2.0)),
        use_routing_bias=bool(_get(d, "use_routing_bias", True)), swiglu_alpha=float(_get(d, "swiglu_alpha", 1.702)),
        swiglu_limit=float(_get(d, "swiglu_limit", 7.0)),
        tie_word_embeddings=bool(_get(d, "tie_word_embeddings", raw.get("tie_word_embeddings", False))),
        moe_layers=_moe_layers(d, shape, n), bos_token_id=d.get("bos_token_id"),
        eos_token_ids=() if eos is None else tuple(int(v) for v in (eos if isinstance(eos, list) else [eos])),
        shape=shape, model_type=str(raw.get("model_type", d.get("model_type", ""))),
        architectures=tuple(raw.get("architectures") or d.get("architectures") or []), **_sparse_fields(d, shape, n))


def load_config(model_path: str | Path) -> ModelConfig:
    """Read `<model_path>/config.json` (or a config.json path) into a ModelConfig."""
    path = Path(model_path, "config.json") if Path(model_path).is_dir() else Path(model_path)
    if not path.is_file():
        raise ConfigError(f"config.json not found at {path}")
    try:
        return config_from_dict(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path} is not valid JSON: {e}") from e
