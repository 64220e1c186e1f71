"""Server flags (SGLang's names where they exist) and their translation into EngineArgs."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from engine.engine_args import EngineArgs


@dataclass
class ServerArgs:
    model_path: str = "configs/tiny"
    tokenizer_path: str | None = None
    skip_tokenizer_init: bool = False
    load_format: str = "auto"
    host: str = "127.0.0.1"
    port: int = 30000
    device: str | None = None
    dtype: str = "auto"
    context_length: int | None = None
    max_running_requests: int = 64
    max_total_tokens: int | None = None
    kv_cache_bytes: int | None = None
    mem_fraction_static: float = 0.8
    chunked_prefill_size: int = 2048
    page_size: int = 1
    disable_radix_cache: bool = False
    random_seed: int = 0
    num_threads: int = 0  # torch intra-op threads for this process; 0 keeps torch's default
    served_model_name: str | None = None
    enable_metrics: bool = False
    api_key: str | None = None
    log_level: str = "info"
    shutdown_grace_period: float = 30.0  # SIGTERM: seconds running requests get to finish
    incremental_streaming_output: bool = False
    cors_origins: list[str] = field(default_factory=list)  # CORS is off unless origins are named
    max_request_bytes: int = 1 << 20  # request bodies above this are refused before parsing (413)
    max_batch_size: int = 256  # prompts (x n) in one /generate or /v1 request
    max_new_tokens_cap: int | None = None  # upper bound on any request's max_new_tokens (None: the context length)

    def engine_args(self) -> EngineArgs:
        names = {f.name for f in fields(EngineArgs)}
        return EngineArgs(**{k: getattr(self, k) for k in names})

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model_path


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m server", description="MiniMax-M3-style sparse-attention LM server")
    defaults = ServerArgs()
    for f in fields(ServerArgs):
        default = getattr(defaults, f.name)
        if isinstance(default, bool):
            p.add_argument(_flag(f.name), action="store_true", default=default)
        elif isinstance(default, list):
            p.add_argument(_flag(f.name), nargs="*", default=[])
        else:
            kind = {int: int, float: float}.get(type(default), str)
            if f.name in ("max_total_tokens", "context_length", "kv_cache_bytes", "max_new_tokens_cap"):
                kind = int
            p.add_argument(_flag(f.name), type=kind, default=default)
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    ns = build_parser().parse_args(argv)
    return ServerArgs(**vars(ns))
