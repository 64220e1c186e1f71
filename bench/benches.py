"""The registry of benchmarks, in the order a full run executes them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from bench import decode, kv_memory, long_context, prefix_cache, server_load, throughput
from bench.context import BenchContext

BENCHES: Mapping[str, Callable[[BenchContext], dict]] = MappingProxyType({
    "kv_memory": kv_memory.run, "decode": decode.run, "prefix_cache": prefix_cache.run,
    "long_context": long_context.run, "throughput": throughput.run, "server_load": server_load.run,
})
