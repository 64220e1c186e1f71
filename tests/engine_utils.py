"""Helpers to drive an Engine step by step in tests."""

from __future__ import annotations

import random
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


def forced_retraction(engine: Engine) -> dict[str, int]:
    """Six requests of 200 + 60 tokens that cannot all decode in the engine's pool (1,500 slots): run them; for each
    retracted one, the tokens it had computed that its (last) readmission did not find cached."""
    sched, computed, recomputed = engine._scheduler, {}, {}
    retract, admit = sched.retract, sched._admit

    def on_retract(req) -> None:
        computed[req.rid] = req.num_computed
        retract(req)

    def on_admit(req) -> None:
        admit(req)
        if req.rid in computed:  # (the last admission counts: one given back for want of room is admitted again)
            recomputed[req.rid] = computed[req.rid] - req.kv.cached

    sched.retract, sched._admit = on_retract, on_admit
    rng = random.Random(2)
    for _ in range(6):
        submit(engine, [rng.randrange(5, 4000) for _ in range(200)], max_new_tokens=60, temperature=0,
               ignore_eos=True)
    run_all(engine)
    return recomputed
