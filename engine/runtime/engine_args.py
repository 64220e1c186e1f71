"""Engine settings, named after SGLang's server flags (see architecture.md)."""

from dataclasses import dataclass

from mem_cache.hicache import WRITE_POLICIES


@dataclass
class EngineArgs:
    model_path: str = "configs/tiny"
    tokenizer_path: str | None = None
    skip_tokenizer_init: bool = False
    load_format: str = "auto"  # auto | safetensors | dummy
    device: str | None = None  # None: cuda when present, else cpu
    dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    context_length: int | None = None  # None: the model's max_position_embeddings
    max_running_requests: int = 64
    max_total_tokens: int | None = None  # KV pool size in tokens; None: from the byte budget
    kv_cache_bytes: int | None = None  # KV pool byte budget; None: 512 MiB on CPU, mem_fraction_static on CUDA
    mem_fraction_static: float = 0.8
    chunked_prefill_size: int | None = None  # None: 2048 on CPU, 8192 on CUDA (SGLang's for an 80-140 GB GPU)
    page_size: int = 1
    disable_radix_cache: bool = False
    random_seed: int = 0
    max_new_tokens_cap: int | None = None  # upper bound on any request's max_new_tokens (None: the context length)
    disable_cuda_graph: bool = False  # decode eager instead of as captured graphs (inductor on CPU)
    cuda_graph_max_bs: int | None = None  # largest decode batch captured (None: max_running_requests, capped)
    cuda_graph_bs: list[int] | None = None  # the batch-size buckets (None: derived from cuda_graph_max_bs)
    enable_torch_compile: bool = False  # CUDA: the decode step compiled (inductor) before capture (CPU: always)
    disable_overlap_schedule: bool = False  # CUDA: read each step's tokens back before launching the next
    num_threads: int = 0  # CPU threads (torch's); 0: torch's default less the cores others keep busy at start
    enable_hierarchical_cache: bool = False  # keep what the device's prefix cache evicts in host memory (and disk)
    hicache_ratio: float = 2.0  # host tier size in tokens, as a multiple of the device pool's
    hicache_size: float = 0.0  # host tier size in GB (1e9 bytes); overrides hicache_ratio when set
    hicache_write_policy: str = "write_through"  # write_through: copy on insert; write_back: copy on eviction
    hicache_storage_backend: str | None = None  # "file": a disk tier below the host one, in hicache_storage_dir
    hicache_storage_dir: str = "/tmp/hicache"

    def __post_init__(self) -> None:
        for name, least in (("max_running_requests", 1), ("chunked_prefill_size", 1), ("max_total_tokens", 2),
                            ("max_new_tokens_cap", 1)):
            if (value := getattr(self, name)) is not None and value < least:
                raise ValueError(f"{name} must be at least {least}, got {value}")
        if self.page_size != 1:
            raise ValueError(f"page_size must be 1 (paged KV slots are not supported by the scheduler yet), got {self.page_size}")
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        for name, allowed in (("hicache_write_policy", WRITE_POLICIES), ("hicache_storage_backend", (None, "file"))):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if self.hicache_ratio <= 0 or self.hicache_size < 0:
            raise ValueError(f"hicache_ratio must be > 0 and hicache_size >= 0, got {self.hicache_ratio} and "
                             f"{self.hicache_size}")
        if self.enable_hierarchical_cache and self.disable_radix_cache:
            raise ValueError("enable_hierarchical_cache keeps the prefix cache's evictions: drop disable_radix_cache")
        for bs in self.cuda_graph_bs or ():
            if bs < 1:
                raise ValueError(f"cuda_graph_bs entries must be at least 1, got {bs}")
