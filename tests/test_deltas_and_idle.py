"""Outputs are deltas: joined, they equal the non-streamed result (native and OpenAI); validation is
all or nothing for a batch; an idle engine sleeps (no CPU, no poll delay before the first token); a drain
wakes on the last request's end (no poll either)."""

from __future__ import annotations

import asyncio
import gc
import json
import os
import time

import httpx
import pytest
from engine_utils import make_engine

from engine.runtime.request import LogprobOptions, NewRequest, RequestOutput
from engine.runtime.sampling_params import SamplingParams
from server.async_engine import AsyncEngine, Channel, EngineDeadError
from tests.http_utils import generate, stream
from tests.server_utils import live_server

GREEDY = {"temperature": 0, "ignore_eos": True}


def same(a, b, tol: float = 1e-4) -> bool:
    """Equal structures, floats within `tol` (a prefix-cache hit changes the last bits of a logprob)."""
    if isinstance(a, float) or isinstance(b, float):
        return isinstance(a, (int, float)) and isinstance(b, (int, float)) and abs(a - b) <= tol
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y, tol) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k], tol) for k in a)
    return a == b
LP = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}


@pytest.fixture(scope="module")
def srv():
    with live_server("--incremental-streaming-output", "--enable-metrics", "--max-total-tokens", "8192") as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    with srv.client() as c:
        yield c


def test_native_deltas_joined_equal_the_non_stream_result(client):
    body = {"text": ["Once upon a time", "The cat"], "sampling_params": {**GREEDY, "max_new_tokens": 9}, **LP}
    plain = generate(client, **body)
    frames = stream(client, **body)
    for i, want in enumerate(plain):
        mine = [f for f in frames if f["index"] == i]
        assert "".join(f["text"] for f in mine) == want["text"]
        assert [t for f in mine for t in f["output_ids"]] == want["output_ids"]
        for key in ("input_token_logprobs", "output_token_logprobs", "input_top_logprobs", "output_top_logprobs"):
            assert same([e for f in mine for e in f["meta_info"][key]], want["meta_info"][key]), key
        assert mine[-1]["meta_info"]["finish_reason"] == want["meta_info"]["finish_reason"]


def _sse(r: httpx.Response) -> list[dict]:
    lines = [line[len("data: "):] for line in r.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(x) for x in lines[:-1]]


def test_openai_stream_deltas_joined_equal_the_non_stream_result(client):
    body = {"prompt": ["Once upon a time", "A dog"], "max_tokens": 8, "logprobs": 2, "echo": True, **GREEDY}
    plain = client.post("/v1/completions", json=body).json()
    chunks = _sse(client.post("/v1/completions", json={**body, "stream": True}))
    for want in plain["choices"]:
        mine = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["index"] == want["index"]]
        assert "".join(c["text"] for c in mine) == want["text"]
        for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
            assert same([e for c in mine if c["logprobs"] for e in c["logprobs"][key]], want["logprobs"][key]), key
    chat = {"messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 8, "logprobs": True,
            "top_logprobs": 2, **GREEDY}
    plain = client.post("/v1/chat/completions", json=chat).json()["choices"][0]
    chunks = [c["choices"][0] for c in _sse(client.post("/v1/chat/completions", json={**chat, "stream": True}))]
    assert "".join(c["delta"].get("content", "") for c in chunks) == plain["message"]["content"]
    assert same([e for c in chunks if c.get("logprobs") for e in c["logprobs"]["content"]], plain["logprobs"]["content"])


def _finished_requests(client) -> float:
    text = client.get("/metrics").text
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("sglang:num_requests_total"))


def test_one_invalid_request_in_a_batch_queues_nothing(client):
    before = _finished_requests(client)
    bad = [{"text": ["fine", "also fine"], "sampling_params": [{"max_new_tokens": 4}, {"top_p": 5}]},
           {"input_ids": [[5, 6], [5, 99999]], "sampling_params": {"max_new_tokens": 4}},
           {"text": ["fine", "x" * 10]} | {"rid": ["r1", "r1"]}]
    for body in bad:
        assert client.post("/generate", json=body).status_code == 400
    time.sleep(0.5)
    info = client.get("/server_info").json()["internal_states"][0]
    assert info["num_running_reqs"] == info["num_queue_reqs"] == info["num_in_flight"] == 0
    assert _finished_requests(client) == before  # the valid prompts of those batches never ran


def test_engine_add_requests_is_all_or_nothing():
    engine = make_engine(max_total_tokens=1024)
    good = NewRequest([5, 6, 7], SamplingParams(max_new_tokens=3))
    bad = NewRequest([5, 6, 7], SamplingParams(max_new_tokens=3), LogprobOptions(True, logprob_start_len=9))
    with pytest.raises(ValueError, match="logprob_start_len"):
        engine.add_requests([good, bad])
    st = engine.stats()
    assert not engine.has_work() and st.num_waiting == st.num_running == 0 and st.used_tokens == 0


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_an_idle_server_uses_no_cpu(srv, client):
    generate(client, text="warm", sampling_params={"max_new_tokens": 2})
    time.sleep(1.0)
    before = _cpu_seconds(srv.proc.pid)
    time.sleep(3.0)
    used = _cpu_seconds(srv.proc.pid) - before
    assert used < 0.1, f"an idle server used {used:.2f} s of CPU in 3 s"


def test_the_idle_engine_thread_blocks_until_a_submission_wakes_it():
    """No poll interval: the engine thread makes one blocking wait_for_work call while idle (a poll loop
    would return from it again and again), and a submission wakes that call (it has no timeout)."""
    calls: list[float | None] = []

    def build():
        engine = make_engine(max_total_tokens=4096)
        wait = engine.wait_for_work

        def counted(timeout: float | None = None) -> bool:
            calls.append(timeout)
            return wait(timeout)

        engine.wait_for_work = counted
        return engine

    async def main() -> list[int]:
        ae = AsyncEngine(build)
        ae.start(asyncio.get_running_loop())
        seen = []
        try:
            while ae.warming:  # (what the thread does once warm is what this test watches; the heap is frozen then)
                await asyncio.sleep(0.01)
            for _ in range(3):
                await asyncio.sleep(0.5)  # idle: the thread sits in one call
                seen.append(len(calls))
                assert gc.get_freeze_count() > 0  # (startup's heap out of the collector's full passes: no pause)
                _, channel = ae.submit([NewRequest([5, 6, 7], SamplingParams(max_new_tokens=1))])
                await asyncio.wait_for(channel.get(), timeout=30)
        finally:
            ae.stop()
        return seen

    seen = asyncio.run(main())
    assert gc.get_freeze_count() == 0  # (unfrozen at stop)
    assert all(t is None for t in calls), calls
    assert seen[0] == 1 and seen[1] - seen[0] <= 3 and seen[2] - seen[1] <= 3, seen


def test_drain_wakes_on_the_last_requests_end_and_runs_once():
    """Within a long grace period a drain returns once the running request has finished (not aborted), a few
    event-loop turns after its last output and with no timer in between; a second drain waits for the same one."""
    async def main():
        ae = AsyncEngine(lambda: make_engine(max_total_tokens=4096))
        loop = asyncio.get_running_loop()
        ae.start(loop)
        ended = loop.create_future()
        ae.observer = lambda out, now: out.finished and not ended.done() and ended.set_result(out)
        try:
            _, channel = ae.submit([NewRequest([5, 6, 7], SamplingParams(max_new_tokens=24, ignore_eos=True))])
            await channel.get()  # running
            first, second = ae.drain(3600), ae.drain(3600)
            with pytest.raises(EngineDeadError):
                ae.submit([NewRequest([5, 6, 7], SamplingParams(max_new_tokens=1))])
            out = await ended
            turns = 0
            while not first.done() and turns < 50:  # zero-length yields: a polling drain would still be asleep
                await asyncio.sleep(0)
                turns += 1
            assert first.done() and second.done() and ae.num_in_flight() == 0, turns
            return out
        finally:
            ae.stop()

    out = asyncio.run(main())
    assert out.finish_reason["type"] == "length" and out.completion_tokens == 24


def test_an_engine_thread_call_its_caller_gave_up_on_is_skipped_and_the_engine_lives():
    """A call cancelled while it waits behind another is never run, and the engine thread serves on."""
    async def main():
        ae = AsyncEngine(lambda: make_engine(max_total_tokens=4096))
        ae.start(asyncio.get_running_loop())
        ran: list[str] = []
        try:
            busy = asyncio.ensure_future(ae.on_engine_thread(lambda: time.sleep(0.3) or ran.append("busy")))
            await asyncio.sleep(0.05)  # (the engine thread is inside the first call now)
            cancelled = asyncio.ensure_future(ae.on_engine_thread(lambda: ran.append("cancelled")))
            await asyncio.sleep(0)
            cancelled.cancel()
            await busy
            assert await asyncio.wait_for(ae.on_engine_thread(lambda: "after"), 10) == "after" and ae.alive
            return ran
        finally:
            ae.stop()

    assert asyncio.run(main()) == ["busy"]


def test_an_engine_that_cannot_recover_ends_every_request_and_stops():
    """A step fails and so does failing its requests (as after a sticky CUDA error): every open request still ends,
    with a 500 and the error, and the engine is no longer alive (new requests and calls: EngineDeadError)."""
    def build():
        engine = make_engine(max_total_tokens=4096)
        engine.step = lambda: (_ for _ in ()).throw(RuntimeError("device lost"))
        engine.fail_all = lambda message: (_ for _ in ()).throw(RuntimeError("device lost again"))
        return engine

    async def main():
        ae = AsyncEngine(build)
        ae.start(asyncio.get_running_loop())
        try:
            _, channel = ae.submit([NewRequest([5, 6, 7], SamplingParams(max_new_tokens=4))] * 2)
            outs = [(await asyncio.wait_for(channel.get(), timeout=30))[1] for _ in range(2)]
            with pytest.raises(EngineDeadError):
                ae.submit([NewRequest([5, 6, 7], SamplingParams(max_new_tokens=1))])
            with pytest.raises(EngineDeadError):
                await ae.on_engine_thread(lambda: None)
            return outs, ae.alive, ae.num_in_flight()
        finally:
            ae.stop()

    outs, alive, in_flight = asyncio.run(main())
    assert not alive and in_flight == 0
    assert all(o.finished and o.finish_reason["status_code"] == 500 and "device lost" in o.error for o in outs)


def test_a_result_reader_wakes_at_a_finish_or_a_full_queue_not_at_every_delta():
    """A non-streaming reader (`Channel.quiet`) is not woken by each step's delta, only by a sequence's finish or a
    queue about to merge, and then reads every delta in order; a streaming reader gets each as it comes."""
    def out(i: int, finished: bool = False) -> RequestOutput:
        return RequestOutput("r", [i], str(i), None, i + 1, 3, 0, finished, {"type": "length"} if finished else None)

    async def delivered(quiet: bool, limit: int = 64) -> list[list[int]]:
        """What the reader has read after each of six deltas (the last one finished) was put."""
        channel, got, seen = Channel(limit), [], []
        channel.quiet = quiet

        async def reader() -> None:
            while True:
                got.append((await channel.get())[1].new_ids[0])

        task = asyncio.ensure_future(reader())
        await asyncio.sleep(0)  # (the reader waits)
        for i in range(6):
            channel.put_nowait(0, out(i, finished=i == 5))
            for _ in range(3):  # (a woken reader runs)
                await asyncio.sleep(0)
            seen.append(list(got))
        task.cancel()
        return seen

    assert asyncio.run(delivered(False)) == [list(range(i + 1)) for i in range(6)]
    assert asyncio.run(delivered(True)) == [[]] * 5 + [list(range(6))]
    assert asyncio.run(delivered(True, limit=3)) == [[], [], [0, 1, 2], [0, 1, 2], [0, 1, 2], list(range(6))]
