"""The overlap schedule (on by default on CUDA only), forced on here on CPU: a steady decode step launched before the
last step's tokens are read back gives every request the same tokens, text, finish reasons and logprobs as an engine
that reads each step back first, through stops mid-stream, aborts, retractions and a failed step."""

from __future__ import annotations

import random

import pytest
from engine_utils import make_engine, run_all, solo, submit

from engine.runtime.request import JoinedOutput, LogprobOptions


def overlapped(**kw):
    engine = make_engine(**kw)
    engine._overlap, launched = True, []  # (as on CUDA)
    run = engine._run
    engine._run = lambda batch: launched.append(engine._pending is not None) or run(batch)
    return engine, launched


def specs() -> list[tuple[list[int], dict, LogprobOptions | None]]:
    """Prompts past the top-k window and short ones, every sampling feature, lengths from 1 to 40."""
    rng = random.Random(4)
    kinds = [{"temperature": 0}, {"temperature": 0.8, "sampling_seed": 7},
             {"temperature": 0.8, "top_p": 0.9, "top_k": 20, "sampling_seed": 8},
             {"temperature": 0, "repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.3},
             {"temperature": 0.7, "min_p": 0.05, "min_new_tokens": 6, "sampling_seed": 9},
             {"temperature": 0.8, "n": 2, "sampling_seed": 10}]
    out = []
    for i in range(14):
        params = dict(kinds[i % len(kinds)], max_new_tokens=rng.choice([1, 2, 9, 25, 40]))
        params["max_new_tokens"] = max(params["max_new_tokens"], params.get("min_new_tokens", 0))
        logprob = LogprobOptions(True, top_logprobs_num=3) if i % 4 == 1 else None
        out.append(([rng.randrange(5, 4000) for _ in range(rng.choice([5, 90, 350, 700]))], params, logprob))
    return out


def test_overlapped_steps_give_the_same_outputs():
    work = specs()
    plain = make_engine(max_total_tokens=8192)
    first = [solo(plain, p, lp, **(params | {"n": 1})) for p, params, lp in work[:6]]
    for (_, params, _), got in zip(work, first):  # stop mid-stream: on a token each saw, or on text
        if len(got.output_ids) > 4:
            params["stop_token_ids"] = [got.output_ids[3]]
    work[5][1]["stop"] = [first[5].text[2:4]] if len(first[5].text) > 4 else None
    engine, launched = overlapped(max_total_tokens=8192)
    rids = [submit(engine, p, lp, **params) for p, params, lp in work[:8]]
    joined: dict[str, JoinedOutput] = {}
    for _ in range(6):  # (the rest join mid-run)
        for out in engine.step():
            joined.setdefault(out.rid, JoinedOutput(out.rid)).add(out)
    rids += [submit(engine, p, lp, **params) for p, params, lp in work[8:]]
    got = run_all(engine, joined=joined)  # (integrity after every step)
    assert sum(launched) > 20, "steady steps were meant to be launched before the last one's read-back"
    for (p, params, lp), ids in zip(work, rids):
        for i, rid in enumerate(ids):
            seed = {"sampling_seed": params["sampling_seed"] + i} if "sampling_seed" in params else {}
            want = solo(plain, p, lp, **(params | {"n": 1} | seed))
            assert got[rid].output_ids == want.output_ids, (rid, params)
            assert (got[rid].text, got[rid].finish_reason) == (want.text, want.finish_reason), (rid, params)
            if lp is not None:
                assert [t for _, t in got[rid].logprobs.output_token] == want.output_ids
                for a, b in zip(got[rid].logprobs.output_token, want.logprobs.output_token):
                    assert a[0] == pytest.approx(b[0], abs=1e-4)
    assert any(r.finish_reason["type"] == "stop" for r in got.values())
    assert engine._pending is None  # (a step of finished requests only is dropped, not kept while idle)
    assert engine.flush_cache() and engine.stats().free_tokens == 8192


@pytest.mark.parametrize("abort", [False, True])
def test_retractions_and_an_abort_while_a_step_is_pending(abort):
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 4000) for _ in range(200)] for _ in range(6)]
    params = {"max_new_tokens": 60, "temperature": 0, "ignore_eos": True}
    engine, launched = overlapped(max_total_tokens=1500)  # (six requests of 260 tokens cannot all decode)
    rids = [submit(engine, p, **params)[0] for p in prompts]
    joined: dict[str, JoinedOutput] = {}
    for _ in range(12):
        for out in engine.step():
            joined.setdefault(out.rid, JoinedOutput(out.rid)).add(out)
        assert engine.check_integrity()
    if abort:
        assert engine._pending is not None and engine._pending[0][0].rid == rids[0]
        assert engine._pending[1] is None  # (no logprobs asked: only the ids come back)
        engine.abort(rids[0])
    got = run_all(engine, joined=joined)
    assert sum(launched) > 10 and (got[rids[0]].finish_reason["type"] == "abort") == abort
    if not abort:
        assert sum(got[r].num_retractions for r in rids) > 0, "the pool was meant to force retractions"
    alone = make_engine(max_total_tokens=1500)
    assert [got[r].output_ids for r in rids[1:]] == [solo(alone, p, **params).output_ids for p in prompts[1:]]
    assert engine.flush_cache() and engine.stats().free_tokens == 1500


def test_a_failed_step_while_one_is_pending_fails_only_the_requests_it_held(monkeypatch):
    engine, _ = overlapped()
    params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    submit(engine, [9] * 50, **params)
    for _ in range(4):
        engine.step()
    assert engine._pending is not None
    def failing(*args):
        raise RuntimeError("a kernel failed")

    monkeypatch.setattr(engine._runner, "forward", failing)
    with pytest.raises(RuntimeError):
        engine.step()
    outs = engine.fail_all("a kernel failed")
    assert [o.finish_reason["type"] for o in outs] == ["abort"] and engine.check_integrity()
    monkeypatch.undo()
    assert solo(engine, [9] * 50, **params).output_ids == solo(make_engine(), [9] * 50, **params).output_ids


def test_tokens_that_end_by_length_are_read_back_before_another_step():
    """A request's last token by length is read back before the next step is launched: no step computed in vain
    (only EOS and stops, seen after their read-back, cost a token computed ahead)."""
    def steps(engine) -> int:
        calls, forward = [], engine._runner.forward
        engine._runner.forward = lambda *a: calls.append(1) or forward(*a)
        for n in (3, 8, 8):
            submit(engine, [11] * 40, max_new_tokens=n, temperature=0, ignore_eos=True)
        run_all(engine)
        return len(calls)

    assert steps(overlapped()[0]) == steps(make_engine()) == 8


def test_a_full_batch_with_a_queue_behind_it_still_overlaps():
    """With every row taken, a waiting request cannot be admitted: the next step is a steady decode all the same."""
    engine, launched = overlapped(max_running_requests=2)
    prompts = [[20 + i] * 30 for i in range(4)]
    params = {"max_new_tokens": 20, "temperature": 0, "ignore_eos": True}
    rids = [submit(engine, p, **params)[0] for p in prompts]
    got = run_all(engine)
    assert sum(launched) >= 30  # (two waves of 20 tokens, ~17 steady steps each)
    assert engine.decode_graphs()["overlapped_steps"] == sum(launched)  # (what /server_info reports)
    plain = make_engine()
    assert [got[r].output_ids for r in rids] == [solo(plain, p, **params).output_ids for p in prompts]
    assert plain.decode_graphs()["overlapped_steps"] == 0
