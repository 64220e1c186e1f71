"""Continuous batching under pressure, chunked prefill and the radix prefix cache, against solo runs."""

from __future__ import annotations

import random

import pytest
from engine_utils import make_engine, run_all, solo, submit

from engine.runtime.request import JoinedOutput, LogprobOptions


def random_prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(5, 4096) for _ in range(n)]


def test_64_requests_arriving_over_time_with_a_small_pool_match_solo_runs():
    rng = random.Random(0)
    specs = []
    for i in range(64):
        params = {"max_new_tokens": rng.randint(1, 20), "ignore_eos": rng.random() < 0.5}
        if i % 2:
            params |= {"temperature": 0.8, "top_p": 0.9, "sampling_seed": 1000 + i}
        else:
            params |= {"temperature": 0}
        specs.append((rng.randint(0, 120), random_prompt(rng, rng.randint(1, 600)), params))
    engine = make_engine(max_total_tokens=2400, max_running_requests=24, chunked_prefill_size=512)
    rids: dict[int, str] = {}
    final, step = {}, 0
    while len(rids) < 64 or engine.has_work():
        for i, (arrival, prompt, params) in enumerate(specs):
            if arrival == step:
                (rids[i],) = submit(engine, prompt, **params)
        for out in engine.step():
            final.setdefault(out.rid, JoinedOutput(out.rid)).add(out)
        assert engine.check_integrity()
        step += 1
    assert sum(o.num_retractions for o in final.values()) > 0, "the pool was meant to force retractions"
    alone = make_engine(max_total_tokens=2400, disable_radix_cache=True)
    for i, (_, prompt, params) in enumerate(specs):
        want = solo(alone, prompt, **params)
        got = final[rids[i]]
        assert got.output_ids == want.output_ids, f"request {i} ({params})"
        assert got.finish_reason == want.finish_reason
    assert engine.flush_cache()
    st = engine.stats()
    assert st.free_tokens == 2400 and st.used_tokens == 0 and st.num_running == st.num_waiting == 0


@pytest.mark.parametrize("chunk", [13, 512])
def test_chunked_prefill_sizes_give_identical_tokens(chunk):
    rng = random.Random(1)
    prompts = [random_prompt(rng, n) for n in (300, 77, 5)]
    params = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}
    want = [solo(make_engine(chunked_prefill_size=1), p, **params).output_ids for p in prompts[1:]]
    engine = make_engine(chunked_prefill_size=chunk)
    rids = [submit(engine, p, **params)[0] for p in prompts]
    got = run_all(engine)
    assert [got[r].output_ids for r in rids[1:]] == want
    assert got[rids[0]].output_ids == solo(make_engine(chunked_prefill_size=1), prompts[0], **params).output_ids


def test_prefix_cache_reuse_flush_and_eviction():
    rng = random.Random(2)
    shared = random_prompt(rng, 500)
    lp = LogprobOptions(return_logprob=True, top_logprobs_num=2)
    params = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    cold = make_engine(disable_radix_cache=True)
    engine = make_engine()
    first = solo(engine, shared + random_prompt(rng, 20), lp, **params)
    assert first.cached_tokens == 0
    second_prompt = shared + random_prompt(rng, 30)
    hit = solo(engine, second_prompt, lp, **params)
    assert hit.cached_tokens >= 500 - 1
    want = solo(cold, second_prompt, lp, **params)
    assert hit.output_ids == want.output_ids
    for (a, ta), (b, tb) in zip(hit.logprobs.output_token, want.logprobs.output_token):
        assert ta == tb and abs(a - b) < 1e-4
    assert engine.flush_cache()
    assert solo(engine, second_prompt, **params).cached_tokens == 0

    # eviction: 6 families of prefixes, far more distinct tokens than the pool holds
    small = make_engine(max_total_tokens=1200, max_running_requests=4)
    families = [random_prompt(rng, 300) for _ in range(6)]
    jobs = [families[rng.randrange(6)] + random_prompt(rng, rng.randint(1, 40)) for _ in range(24)]
    rids = [submit(small, j, **params)[0] for j in jobs]
    got = run_all(small)
    assert sum(got[r].cached_tokens for r in rids) > 0
    for r, j in zip(rids, jobs):
        assert got[r].output_ids == solo(cold, j, **params).output_ids


def test_abort_waiting_and_running_frees_slots_at_once():
    engine = make_engine(max_total_tokens=1000, max_running_requests=2)
    rng = random.Random(3)
    ids = [submit(engine, random_prompt(rng, 100), max_new_tokens=500, ignore_eos=True, temperature=0)[0]
           for _ in range(3)]
    for _ in range(3):
        engine.step()
    st = engine.stats()
    assert (st.num_running, st.num_waiting) == (2, 1)
    assert not engine.flush_cache()  # refused while requests run
    for rid in ids:
        engine.abort(rid)
    outs = {o.rid: o for o in engine.step()}
    assert all(outs[r].finished and outs[r].finish_reason["type"] == "abort" for r in ids)
    assert outs[ids[2]].finish_reason["message"] == "Abort in waiting queue"
    assert engine.check_integrity() and not engine.has_work()
    st = engine.stats()
    assert st.free_tokens + st.cached_tokens == 1000 and st.evictable_tokens == st.cached_tokens  # nothing locked


def test_the_default_prefill_budget_is_2048_tokens_a_step_on_cpu():
    """--chunked-prefill-size left out: 2048 tokens a step on CPU (on CUDA 8192, SGLang's for a large GPU): a
    2,100-token prompt samples its first token in its second step."""
    engine = make_engine(max_total_tokens=4096)
    submit(engine, [(7 * i) % 3000 + 20 for i in range(2100)], max_new_tokens=1, temperature=0)
    tokens = [sum(len(o.new_ids) for o in engine.step()) for _ in range(2)]
    assert tokens == [0, 1] and engine.args.chunked_prefill_size is None
