"""A snapshot of the engine's state: what the server, metrics and load reports read (never the scheduler)."""

from dataclasses import dataclass, field


@dataclass(frozen=True)
class EngineStats:
    num_running: int  # requests decoding (or finishing their prefill)
    num_waiting: int  # requests queued, not yet holding KV or retracted
    max_total_tokens: int  # KV token slots
    used_tokens: int  # slots held by requests and the prefix cache
    free_tokens: int
    evictable_tokens: int  # prefix-cache slots no request holds
    cached_tokens: int  # prefix-cache slots
    kv_cache_bytes: int
    captured_batch_sizes: tuple[int, ...]  # decode graph buckets ready to replay
    hit_tokens: dict[str, int] = field(default_factory=dict)  # prefix tokens found per tier (device/host/disk), "miss"
    host_tier: dict | None = None  # HiCache.info(); None when the hierarchical cache is off

    @property
    def token_usage(self) -> float:
        return self.used_tokens / self.max_total_tokens
