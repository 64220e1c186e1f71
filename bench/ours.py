"""Our engine under the benchmark: building it and timing single generations token by token."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.timing import TokenTimes
from bench.workload import greedy, greedy_like_transformers
from engine.runtime.engine import Engine
from engine.runtime.engine_args import EngineArgs
from engine.runtime.llm import LLM
from engine.runtime.request import NewRequest
from engine.runtime.sampling_params import SamplingParams


def make_llm(model_dir: Path, **engine_args: Any) -> LLM:
    """float32 on CPU, as every comparison here runs."""
    return LLM(model_dir, device="cpu", dtype="float32", **engine_args)


def make_engine(model_dir: Path, **engine_args: Any) -> Engine:
    """Warmed up, as a server starts: its decode graphs compiled (none with disable_cuda_graph=True)."""
    engine = Engine(EngineArgs(model_path=str(model_dir), device="cpu", dtype="float32", **engine_args))
    engine.warm_up()
    return engine


def timed_generate(engine: Engine, prompt_ids: list[int], max_new_tokens: int,
                   sampling: Callable[[int], dict] = greedy_like_transformers) -> TokenTimes:
    """Run one greedy request alone through `engine.step()`, stamping every output token's arrival."""
    assert not engine.has_work(), "timed_generate needs an idle engine"
    start = time.perf_counter()
    (rid,) = engine.add_requests([NewRequest(list(prompt_ids), SamplingParams.from_dict(sampling(max_new_tokens)))])[0]
    times: list[float] = []
    ids: list[int] = []
    done, cached = False, None
    while not done:
        for out in engine.step():
            if out.rid != rid:
                continue
            now = time.perf_counter()
            times.extend([now] * len(out.new_ids))
            ids.extend(out.new_ids)
            done, cached = out.finished, out.cached_tokens
    return TokenTimes(start, tuple(times), tuple(ids), cached)


def offline_generate(llm: LLM, prompts: list[list[int]], max_new: list[int]) -> tuple[float, int]:
    """Submit everything at once through `LLM.generate`; (seconds, output tokens produced)."""
    start = time.perf_counter()
    outs = llm.generate(prompts, [greedy(n) for n in max_new], progress=True)
    elapsed = time.perf_counter() - start
    return elapsed, sum(o["meta_info"]["completion_tokens"] for o in outs)
