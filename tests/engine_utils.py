"""Helpers to drive an Engine step by step in tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.runtime.engine import Engine
from engine.runtime.engine_args import EngineArgs
from engine.runtime.request import JoinedOutput, LogprobOptions, NewRequest
from engine.runtime.sampling_params import SamplingParams

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny")


def make_engine(**kw: Any) -> Engine:
    kw.setdefault("model_path", TINY)
    kw.setdefault("max_total_tokens", 4096)
    kw.setdefault("disable_cuda_graph", True)  # eager: graph capture is tested in test_decode_graph
    kw.setdefault("load_format", "dummy")  # seeded random weights: the shipped ones are tested in test_shipped_model
    return Engine(EngineArgs(**kw))


def submit(engine: Engine, prompt: list[int], logprob: LogprobOptions | None = None, **params: Any) -> list[str]:
    return engine.add_requests([NewRequest(prompt, SamplingParams.from_dict(params), logprob or LogprobOptions())])[0]


def run_all(engine: Engine, check: bool = True, joined: dict[str, JoinedOutput] | None = None) -> dict[str, JoinedOutput]:
    """Step until idle; each request's joined outputs (integrity checked after every step)."""
    joined = {} if joined is None else joined
    while engine.has_work():
        for out in engine.step():
            joined.setdefault(out.rid, JoinedOutput(out.rid)).add(out)
        if check:
            assert engine.check_integrity()
    return joined


def solo(engine: Engine, prompt: list[int], logprob: LogprobOptions | None = None, **params: Any) -> JoinedOutput:
    (rid,) = submit(engine, prompt, logprob, **params)
    return run_all(engine, check=False)[rid]
