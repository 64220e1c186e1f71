"""Server flags (SGLang's names where they exist): the engine's (EngineArgs) plus the server's own."""

import argparse
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from engine.runtime.engine_args import EngineArgs

INT_OR_NONE = tuple(f.name for f in fields(EngineArgs) if str(f.type) == "int | None")  # (a None default says no type)


@dataclass
class ServerArgs:
    engine: EngineArgs = field(default_factory=EngineArgs)
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    enable_metrics: bool = False
    api_key: str | None = None
    log_level: str = "info"
    shutdown_grace_period: float = 30.0  # SIGTERM: seconds running requests get to finish
    incremental_streaming_output: bool = False
    cors_origins: list[str] = field(default_factory=list)  # CORS is off unless origins are named
    max_request_bytes: int = 1 << 20  # request bodies above this are refused before parsing (413)
    max_batch_size: int = 256  # prompts (x n) in one /generate or /v1 request
    max_logprobs: int = 20  # largest top_logprobs (chat) / logprobs x4 (completions) the OpenAI routes take
    enable_cache_report: bool = False  # OpenAI usage: prompt_tokens_details.cached_tokens (else null)

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.engine.model_path

    def flat(self) -> dict[str, Any]:
        """Every flag, engine ones included, as one flat dict (what /server_info shows)."""
        out = asdict(self.engine) | {f.name: getattr(self, f.name) for f in fields(self) if f.name != "engine"}
        out["model_path"] = str(Path(self.engine.model_path).resolve())
        if self.engine.tokenizer_path:
            out["tokenizer_path"] = str(Path(self.engine.tokenizer_path).resolve())
        return out


def _add(p: argparse.ArgumentParser, name: str, default: Any) -> None:
    flag = "--" + name.replace("_", "-")
    if isinstance(default, bool):
        p.add_argument(flag, action="store_true", default=default)
    elif isinstance(default, list) or name == "cuda_graph_bs":
        p.add_argument(flag, nargs="*", type=int if name == "cuda_graph_bs" else str, default=default)
    else:
        kind = int if name in INT_OR_NONE else {int: int, float: float}.get(type(default), str)
        p.add_argument(flag, type=kind, default=default)


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    p = argparse.ArgumentParser(prog="python -m server", description="MiniMax-M3-style sparse-attention LM server")
    for name, default in asdict(EngineArgs()).items():
        _add(p, name, default)
    p.add_argument("--disable-torch-compile", action="store_true", dest="disable_cuda_graph",
                   help="the same switch as --disable-cuda-graph: decode runs eager")
    for name, default in asdict(ServerArgs()).items():
        if name != "engine":
            _add(p, name, default)
    p.add_argument("--enable-prompt-tokens-details", action="store_true", dest="enable_cache_report",
                   help="vLLM's name for --enable-cache-report")
    ns, names = vars(p.parse_args(argv)), {f.name for f in fields(EngineArgs)}
    engine = EngineArgs(**{k: v for k, v in ns.items() if k in names})
    return ServerArgs(engine=engine, **{k: v for k, v in ns.items() if k not in names})
