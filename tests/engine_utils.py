"""Helpers to drive an Engine step by step in tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from engine.engine import Engine
from engine.engine_args import EngineArgs
from engine.request import LogprobOptions, RequestOutput
from engine.sampling import SamplingParams

TINY = str(Path(__file__).resolve().parents[1] / "configs" / "tiny")


def make_engine(**kw: Any) -> Engine:
    kw.setdefault("model_path", TINY)
    kw.setdefault("max_total_tokens", 4096)
    return Engine(EngineArgs(**kw))


def submit(engine: Engine, prompt: list[int], logprob: LogprobOptions | None = None, **params: Any) -> list[str]:
    return engine.add_request(prompt, SamplingParams.from_dict(params), logprob)


def run_all(engine: Engine, check: bool = True) -> dict[str, RequestOutput]:
    """Step until idle; returns each request's final output (integrity checked after every step)."""
    final: dict[str, RequestOutput] = {}
    while engine.has_work():
        for out in engine.step():
            if out.finished:
                final[out.rid] = out
        if check:
            assert engine.check_integrity()
    return final


def solo(engine: Engine, prompt: list[int], logprob: LogprobOptions | None = None, **params: Any) -> RequestOutput:
    (rid,) = submit(engine, prompt, logprob, **params)
    return run_all(engine, check=False)[rid]
