"""Model configuration: one frozen dataclass that validates itself (every error names the field); see config_json.py."""

import math
from dataclasses import dataclass

LAYER_KINDS = ("dense", "sparse_index_kv", "sparse_k_only")


class ConfigError(ValueError):
    """A config.json value we cannot serve; the message names the field."""


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    max_position_embeddings: int
    rms_norm_eps: float
    intermediate_size: int
    dense_intermediate_size: int
    shared_intermediate_size: int  # total shared-expert width (size x n_shared_experts)
    num_experts: int
    num_experts_per_tok: int
    routed_scaling_factor: float
    use_routing_bias: bool
    swiglu_alpha: float
    swiglu_limit: float
    tie_word_embeddings: bool
    layer_kinds: tuple[str, ...]  # per layer: dense | sparse_index_kv | sparse_k_only
    moe_layers: tuple[bool, ...]  # per layer: True = MoE, False = dense MLP
    index_num_heads: int
    index_head_dim: int
    block_size: int
    topk_blocks: int
    init_blocks: int
    local_blocks: int
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    shape: str = "minimax"  # which config.json shape it came from: minimax | transformers
    model_type: str = ""
    architectures: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def any_sparse(self) -> bool:
        return any(k != "dense" for k in self.layer_kinds)


def _require(cond: bool, field: str, msg: str) -> None:
    if not cond:
        raise ConfigError(f"config field '{field}': {msg}")


def _validate(c: ModelConfig) -> None:
    for f in ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
              "intermediate_size", "dense_intermediate_size", "max_position_embeddings"):
        _require(isinstance(getattr(c, f), int) and getattr(c, f) >= 1, f, f"must be a positive integer, got {getattr(c, f)!r}")
    _require(c.num_heads % c.num_kv_heads == 0, "num_key_value_heads",
             f"num_attention_heads ({c.num_heads}) must be a multiple of num_key_value_heads ({c.num_kv_heads})")
    _require(0 < c.rotary_dim <= c.head_dim and c.rotary_dim % 2 == 0, "rotary_dim",
             f"rotary dim must be even and in (0, head_dim={c.head_dim}], got {c.rotary_dim}")
    _require(math.isfinite(c.rope_theta) and c.rope_theta > 0, "rope_theta", f"must be positive, got {c.rope_theta}")
    _require(len(c.layer_kinds) == c.num_layers and all(k in LAYER_KINDS for k in c.layer_kinds),
             "layer_kinds", f"one of {LAYER_KINDS} per layer, got {c.layer_kinds}")
    _require(len(c.moe_layers) == c.num_layers, "moe_layer_freq", "one entry per layer")
    if any(c.moe_layers):
        _require(c.num_experts >= 1, "num_local_experts", f"must be >= 1, got {c.num_experts}")
        _require(1 <= c.num_experts_per_tok <= c.num_experts, "num_experts_per_tok",
                 f"must be in [1, num_local_experts={c.num_experts}], got {c.num_experts_per_tok}")
        _require(c.shared_intermediate_size >= 0, "shared_intermediate_size", "must be >= 0")
    if c.any_sparse:
        _require(c.index_num_heads == c.num_kv_heads, "sparse_num_index_heads", f"index heads ({c.index_num_heads}) "
                 f"must equal num_key_value_heads ({c.num_kv_heads}): one block selection per KV head")
        _require(c.index_head_dim >= c.rotary_dim, "sparse_index_dim",
                 f"index head dim ({c.index_head_dim}) must be >= the rotary dim ({c.rotary_dim})")
        _require(c.topk_blocks >= 1, "sparse_topk_blocks", f"must be >= 1, got {c.topk_blocks}")
        _require(c.block_size >= 1, "sparse_block_size", f"must be >= 1, got {c.block_size}")
        _require(c.local_blocks >= 1, "sparse_local_block",
                 f"must be >= 1 (every query must see its own block), got {c.local_blocks}")
        _require(c.init_blocks >= 0, "sparse_init_block", f"must be >= 0, got {c.init_blocks}")
        _require(c.init_blocks + c.local_blocks <= c.topk_blocks, "sparse_topk_blocks", f"init blocks ({c.init_blocks})"
                 f" + local blocks ({c.local_blocks}) must fit in the top-k budget ({c.topk_blocks})")
