"""What every benchmark gets: the run's scale (full or quick), the model directories and the
machine's measured memory bandwidth."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Scale:
    """Sizes of one run. `FULL` is the benchmark as specified; `QUICK` is a ~2-minute smoke run."""

    decode_prompt: int = 128
    decode_new: int = 128
    decode_runs: int = 3
    tp_requests: int = 64
    tp_prompt: tuple[int, int] = (32, 1024)
    tp_output: tuple[int, int] = (32, 256)
    tp_batch: int = 16
    lc_contexts: tuple[int, ...] = (1024, 4096, 16384, 32768)
    lc_hf_max_context: int = 32768
    lc_new: int = 32
    lc_timeout_s: float = 300.0
    lc_mem_cap_bytes: int = 16 << 30
    lc_pool_tokens: int = 34_000
    lc_chunked_prefill: int = 8192
    prefix_len: int = 4096
    prefix_suffix: int = 32
    prefix_runs: int = 3
    load_levels: tuple[int, ...] = (1, 8, 32, 64)
    load_min_requests: int = 16
    load_prompt: tuple[int, int] = (224, 288)
    load_new: tuple[int, int] = (64, 128)


FULL = Scale()
QUICK = Scale(
    decode_new=32, tp_requests=12, tp_prompt=(32, 256), tp_output=(8, 32), tp_batch=3,
    lc_contexts=(1024, 4096), lc_hf_max_context=4096, lc_pool_tokens=5000, lc_timeout_s=120.0,
    prefix_len=2048, load_levels=(1, 4, 12), load_min_requests=4, load_prompt=(96, 160), load_new=(8, 16),
)


@dataclass(frozen=True)
class ModelDirs:
    tiny: Path  # configs/tiny: our default model (seeded dummy weights)
    hf_copy: Path  # transformers save_pretrained copy of the same weights (sparse layers K-only)
    hf_copy_dense: Path  # the copy's weights with every layer dense (config.json + index over the same file)


@dataclass(frozen=True)
class Bandwidth:
    copy_bytes_per_s: float  # bytes copied per second (primary roofline figure)
    stream_bytes_per_s: float  # STREAM-style: bytes read + bytes written per second
    tensor_bytes: int
    repeats: int


@dataclass(frozen=True)
class BenchContext:
    quick: bool
    scale: Scale
    seed: int
    models: ModelDirs
    bandwidth: Bandwidth
    workdir: Path  # scratch (temp) directory of this run


def context_to_json(ctx: BenchContext) -> str:
    d = dataclasses.asdict(ctx)
    return json.dumps(d, default=str)


def context_from_json(text: str) -> BenchContext:
    d = json.loads(text)
    scale = Scale(**{k: tuple(v) if isinstance(v, list) else v for k, v in d["scale"].items()})
    models = ModelDirs(**{k: Path(v) for k, v in d["models"].items()})
    return BenchContext(quick=d["quick"], scale=scale, seed=d["seed"], models=models,
                        bandwidth=Bandwidth(**d["bandwidth"]), workdir=Path(d["workdir"]))
