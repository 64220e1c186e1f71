"""Prometheus metrics with SGLang's names (http_api.md §3 /metrics), own registry: request counters and histograms fed
on the event loop; engine gauges (scheduler, pools) read at scrape time (plain ints and list lengths: loop-safe)."""

import time
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from engine.runtime.request import RequestOutput

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
TTFT_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400]
ITL_BUCKETS = [0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.025, 0.030, 0.035, 0.040, 0.060, 0.080,
               0.100, 0.200, 0.400, 0.600, 0.800, 1.0, 2.0, 4.0, 6.0, 8.0]
E2E_BUCKETS = [0.1, 0.2, 0.4, 0.6, 0.8, 1, 2, 4, 6, 8, 10, 20, 40, 60, 80, 100, 200, 400, 600, 1200, 1800, 2400]
QUEUE_BUCKETS = [0.0, 0.01, 0.05, 0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300, 600]
THROUGHPUT_WINDOW_S = 10.0


@dataclass
class _ReqTimes:
    arrival: float
    last_token: float | None = None  # None until the first token
    seen_tokens: int = 0


class Metrics:
    def __init__(self, model_name: str, engine: Any) -> None:
        self.model_name, self.engine, self.registry = model_name, engine, CollectorRegistry()
        lab, reg = ["model_name"], self.registry

        def counter(name: str, doc: str) -> Any:
            return Counter(f"sglang:{name}", doc, lab, registry=reg).labels(model_name)

        def histogram(name: str, what: str, buckets: list[float]) -> Any:
            doc = f"Histogram of {what}"
            return Histogram(f"sglang:{name}", doc, lab, registry=reg, buckets=buckets).labels(model_name)

        self.prompt_tokens = counter("prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("generation_tokens", "Number of generation tokens processed.")
        self.cached_tokens = counter("cached_tokens", "Number of cached prompt tokens.")
        self.num_requests = counter("num_requests", "Number of requests processed.")
        self.num_aborted = counter("num_aborted_requests", "Number of requests aborted.")
        self.num_so = counter("num_so_requests", "Number of structured output requests processed.")
        self.ttft = histogram("time_to_first_token_seconds", "time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "inter-token latency in seconds.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "End-to-end request latency in seconds", E2E_BUCKETS)
        # NOTE: no engine admission time: queue time runs up to the first output (queueing + prefill), the closest seen.
        self.queue_time = histogram("queue_time_seconds", "queueing time in seconds.", QUEUE_BUCKETS)
        reg.register(self)  # its collect() gives the engine gauges
        self._reqs: dict[str, _ReqTimes] = {}
        self._recent: deque[tuple[float, int]] = deque()  # (time, tokens generated before then) for gen_throughput
        self._generated = 0  # (so the window's tokens are a difference, not a sum over it at every output)
        self._prompt_total = self._cached_total = 0

    def collect(self) -> Any:
        st, pool = self.engine.stats(), self.engine.pool
        values = {"num_running_reqs": ("The number of running requests.", st.num_running),
                  "num_used_tokens": ("The number of used KV tokens (prefix cache included).", st.used_tokens),
                  "token_usage": ("The KV token usage (0-1).", st.token_usage),
                  "gen_throughput": ("The generation throughput (token/s).", self.gen_throughput()),
                  "num_queue_reqs": ("The number of requests in the waiting queue.", st.num_waiting),
                  "num_grammar_queue_reqs": ("The number of requests in the grammar queue.", 0),
                  "cache_hit_rate": ("The prefix cache hit rate.",
                                     self._cached_total / self._prompt_total if self._prompt_total else 0.0),
                  "spec_accept_length": ("The average speculative accept length.", 0.0),
                  "max_total_num_tokens": ("The KV pool size in tokens.", st.max_total_tokens)}
        gauge, counter = (partial(_family, cls, self.model_name) for cls in (GaugeMetricFamily, CounterMetricFamily))
        for name, (doc, value) in values.items():
            yield gauge(name, doc, {None: value})
        per_pool = {"pool_used_tokens": ("Used token slots of a KV sub-pool.", lambda p: st.used_tokens),
                    "pool_free_tokens": ("Free token slots of a KV sub-pool.", lambda p: st.free_tokens),
                    "pool_bytes": ("Allocated bytes of a KV sub-pool.", lambda p: p.total_bytes())}
        for name, (doc, fn) in per_pool.items():
            yield gauge(name, doc, {p.name: fn(p) for p in pool.sub_pools()}, "pool")
        hits, host = st.hit_tokens, st.host_tier
        yield counter("cache_hit_tokens", "Prefix tokens found in a cache tier.",
                      {t: hits.get(t, 0) for t in ("device", "host", "disk")}, "tier")
        yield counter("cache_miss_tokens", "Prefix tokens found in no tier.", {None: hits.get("miss", 0)})
        if host is not None:
            ways = ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host")
            yield counter("hicache_moved_bytes", "KV bytes copied between cache tiers.",
                          {w: host["moved_bytes"].get(w, 0) for w in ways}, "direction")
            yield gauge("hicache_host_used_tokens", "Host KV tier slots in use.", {None: host["used_tokens"]})
            yield gauge("hicache_host_total_tokens", "Host KV tier size in tokens.", {None: host["size_tokens"]})

    def on_submit(self, rids: list[str], now: float) -> None:
        self._reqs.update({rid: _ReqTimes(now) for rid in rids})

    def observe(self, out: RequestOutput, now: float) -> None:
        if (t := self._reqs.get(out.rid)) is None:  # not submitted through AsyncEngine (e.g. engine-internal)
            return
        if (new := out.completion_tokens - t.seen_tokens) > 0:
            if t.last_token is None:
                self.ttft.observe(now - t.arrival)
                self.queue_time.observe(now - t.arrival)
                self._itl(now - t.arrival, new - 1)
            else:
                self._itl(now - t.last_token, new)
            t.last_token, t.seen_tokens = now, out.completion_tokens
            self._recent.append((now, self._generated))
            self._generated += new
            self.gen_throughput(now)  # prunes the window
        if out.finished:
            del self._reqs[out.rid]
            self.prompt_tokens.inc(out.prompt_tokens)
            self.generation_tokens.inc(out.completion_tokens)
            self.cached_tokens.inc(out.cached_tokens)
            self._prompt_total += out.prompt_tokens
            self._cached_total += out.cached_tokens
            self.num_requests.inc()
            if (out.finish_reason or {}).get("type") == "abort":
                self.num_aborted.inc()
            self.e2e.observe(now - t.arrival)

    def _itl(self, interval: float, tokens: int) -> None:
        for _ in range(tokens):
            self.itl.observe(interval / tokens)

    def gen_throughput(self, now: float | None = None) -> float:
        """Generated tokens per second over the last THROUGHPUT_WINDOW_S seconds."""
        now = time.monotonic() if now is None else now
        while self._recent and self._recent[0][0] < now - THROUGHPUT_WINDOW_S:
            self._recent.popleft()
        return (self._generated - self._recent[0][1]) / THROUGHPUT_WINDOW_S if self._recent else 0.0

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _family(cls: Any, model: str, name: str, doc: str, values: dict, label: str | None = None) -> Any:
    """Metric family `sglang:<name>`: a sample per `values` entry (label value -> n; {None: n}: model label only)."""
    family = cls(f"sglang:{name}", doc, labels=["model_name", *([label] if label else [])])
    for key, value in values.items():
        family.add_metric([model, *([key] if label else [])], float(value))
    return family
