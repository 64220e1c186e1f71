"""Faults against live servers, each followed by the three checks of tests/reliability_utils.py:
(i) pool integrity, (ii) no token held once idle and none after /flush_cache, (iii) the same greedy tokens.

Scenarios: streaming clients killed mid-stream; slow readers that stop reading; aborts of queued and
running requests and abort_all under mixed load; a KV pool far too small for the load; an exception
inside the engine for some requests (injected by the test-only wrapper tests/fault_server.py); SIGTERM under load.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
from typing import Any

import httpx
import pytest

from server.async_engine import MAX_BACKLOG
from tests.http_utils import sse_frames
from tests.reliability_utils import (
    check_envelope,
    internal_state,
    reference_ids,
    three_checks,
    wait_idle,
)
from tests.server_utils import live_server

GREEDY = {"temperature": 0, "ignore_eos": True}
LONG = {"max_new_tokens": 3000, "ignore_eos": True}
MAX_RUNNING = 8
FAULT_PREFIX, FAULT_AFTER = "boom", 3


@pytest.fixture(scope="module")
def srv():
    env = {"FAULT_RID_PREFIX": FAULT_PREFIX, "FAULT_AFTER_TOKENS": str(FAULT_AFTER)}
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        with live_server("--max-running-requests", str(MAX_RUNNING), "--max-total-tokens", "30000",
                         "--context-length", "4096", "--shutdown-grace-period", "2", module="tests.fault_server") as s:
            yield s


def _client(url: str, n: int = 64) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=n))


async def _wait_state(c: httpx.AsyncClient, pred, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = (await c.get("/server_info")).json()["internal_states"][0]
        if pred(st):
            return st
        assert time.monotonic() < deadline, st
        await asyncio.sleep(0.05)


# ---- clients killed mid-stream ---------------------------------------------------------------------------
def test_32_streaming_clients_killed_mid_stream(srv, client, reference):
    async def doomed(i: int) -> int:
        if i % 3 == 0:
            path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"killed {i}"}],
                                                  "max_tokens": 3000, "ignore_eos": True, "stream": True}
        elif i % 3 == 1:
            path, body = "/v1/completions", {"prompt": f"killed {i}", "max_tokens": 3000, "ignore_eos": True,
                                             "stream": True}
        else:
            path, body = "/generate", {"text": f"killed {i}", "stream": True, "sampling_params": LONG}
        frames = 0
        async with httpx.AsyncClient(base_url=srv.url, timeout=120) as c, c.stream("POST", path, json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                frames += line.startswith("data: ")
                if frames >= 2 + i % 5:
                    break  # leaving both contexts drops the connection mid-stream
        return frames

    async def run() -> list[int]:
        return await asyncio.gather(*(doomed(i) for i in range(32)))

    assert all(f >= 2 for f in asyncio.run(run()))
    three_checks(client, reference)


# ---- slow readers --------------------------------------------------------------------------------------
def _stalled_stream(port: int, body: dict) -> socket.socket:
    """Send a streaming request and never read the response (a tiny receive buffer fills at once)."""
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(("127.0.0.1", port))
    data = json.dumps(body).encode()
    s.sendall(b"POST /generate HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
              b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    return s


def test_slow_readers_neither_block_others_nor_pile_up_outputs(srv, client, reference):
    port = int(srv.url.rsplit(":", 1)[1])
    # every cumulative frame repeats the prompt's 300 x 200 top logprobs: the socket buffers fill with
    # the first frames, and each frame costs real time to shape and serialize
    body = {"input_ids": [(7 * i) % 4000 + 10 for i in range(300)], "stream": True, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 200,
            "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}
    socks = [_stalled_stream(port, {**body, "rid": f"slow{i}"}) for i in range(4)]
    try:
        deadline = time.monotonic() + 90
        while internal_state(client)["num_pending_outputs"] < 4 * MAX_BACKLOG:
            assert time.monotonic() < deadline, internal_state(client)
            time.sleep(0.1)
        # the stalled streams hold their outputs at the bound, and the others are served meanwhile
        t0 = time.monotonic()
        assert reference_ids(client) == reference
        assert time.monotonic() - t0 < 30
        r = client.post("/v1/completions", json={"prompt": "meanwhile", "max_tokens": 4})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        st = internal_state(client)
        assert st["num_pending_outputs"] <= 4 * MAX_BACKLOG and st["num_running_reqs"] == 4, st
        assert st["integrity_ok"] is True
    finally:
        for s in socks:
            s.close()
    # the disconnects are seen at once (not after the backlog has been serialized for nobody): the
    # event loop answers, and the streams are aborted and their slots freed, within seconds
    t0 = time.monotonic()
    wait_idle(client, timeout=10)
    assert time.monotonic() - t0 < 3
    three_checks(client, reference)


# ---- aborts --------------------------------------------------------------------------------------------
def test_abort_queued_and_running_requests_then_abort_all(srv, client, reference):
    async def run() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with _client(srv.url) as c:
            body = {"text": "abort target", "sampling_params": LONG}
            running = [asyncio.ensure_future(c.post("/generate", json={**body, "rid": f"run{i}"}))
                       for i in range(MAX_RUNNING)]
            await _wait_state(c, lambda st: st["num_running_reqs"] == MAX_RUNNING)
            queued = [asyncio.ensure_future(c.post("/generate", json={**body, "rid": f"queued{i}"})) for i in range(4)]
            await _wait_state(c, lambda st: st["num_queue_reqs"] == 4)
            for rid in ("queued0", "run0"):  # (queued0 first: once run0 ends, it may be admitted before its abort)
                r = await c.post("/abort_request", json={"rid": rid})
                assert r.status_code == 200 and r.content == b""
            first = await asyncio.gather(running[0], queued[0])
            await _wait_state(c, lambda st: st["num_running_reqs"] == MAX_RUNNING and st["num_queue_reqs"] == 2)
            r = await c.post("/abort_request", json={"abort_all": True})
            assert r.status_code == 200
            return list(first), await asyncio.gather(*running[1:], *queued[1:])

    (run0, queued0), rest = asyncio.run(run())
    fr = run0.json()["meta_info"]["finish_reason"]
    assert run0.status_code == 200 and fr["type"] == "abort" and fr["message"] == "Aborted by request."
    assert 0 < run0.json()["meta_info"]["completion_tokens"] < 3000
    assert queued0.status_code == 200 and queued0.json()["meta_info"]["finish_reason"]["message"] == "Abort in waiting queue"
    assert queued0.json()["output_ids"] == []
    assert [r.status_code for r in rest] == [200] * len(rest)
    reasons = [r.json()["meta_info"]["finish_reason"] for r in rest]
    assert all(f["type"] == "abort" for f in reasons)
    assert sum(f["message"] == "Abort in waiting queue" for f in reasons) == 2
    three_checks(client, reference)


def test_abort_all_under_mixed_load_answers_every_request_with_abort(srv, client, reference):
    async def run() -> list[Any]:
        async with _client(srv.url) as c:
            async def native(i: int, stream: bool) -> str:
                body = {"text": f"mixed {i}", "stream": stream, "sampling_params": LONG}
                r = await c.post("/generate", json=body)
                assert r.status_code == 200
                out = sse_frames(r.text)[-1] if stream else r.json()
                return out["meta_info"]["finish_reason"]["type"]

            async def openai(i: int, stream: bool) -> str:
                if i % 2:
                    path, body = "/v1/completions", {"prompt": f"oai {i}", "max_tokens": 3000}
                else:
                    path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": f"oai {i}"}],
                                                          "max_tokens": 3000}
                r = await c.post(path, json={**body, "ignore_eos": True, "stream": stream})
                assert r.status_code == 200
                if not stream:
                    return r.json()["choices"][0]["finish_reason"]
                frames = sse_frames(r.text)
                return next(ch["finish_reason"] for f in frames for ch in f["choices"] if ch["finish_reason"])

            tasks = [asyncio.ensure_future(f(i, s)) for i in range(4) for f in (native, openai) for s in (False, True)]
            await _wait_state(c, lambda st: st["num_running_reqs"] == MAX_RUNNING and st["num_queue_reqs"] > 0)
            await asyncio.sleep(0.3)
            assert (await c.post("/abort_request", json={"abort_all": True})).status_code == 200
            return await asyncio.gather(*tasks)

    assert asyncio.run(run()) == ["abort"] * 16
    three_checks(client, reference)


# ---- an exception inside the engine for some requests ---------------------------------------------------
def test_engine_fault_fails_only_its_requests(srv, client, reference):
    async def run() -> tuple[list[httpx.Response], list[httpx.Response]]:
        async with _client(srv.url) as c:
            faulty = [
                c.post("/generate", json={"text": "x", "rid": "boom-native", "sampling_params": {"max_new_tokens": 20}}),
                c.post("/generate", json={"text": "x", "rid": "boom-stream", "stream": True,
                                          "sampling_params": {"max_new_tokens": 20}}),
                c.post("/v1/completions", json={"prompt": "x", "rid": "boom-oai", "max_tokens": 20}),
                c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}],
                                                     "rid": "boom-chat", "max_tokens": 20, "stream": True}),
                c.post("/generate", json={"text": ["x", "y"], "rid": "boom-batch", "sampling_params": {"max_new_tokens": 20}}),
            ]
            healthy = [c.post("/generate", json={"text": f"fine {i}", "sampling_params": {**GREEDY, "max_new_tokens": 12}})
                       for i in range(6)]
            outs = await asyncio.gather(*faulty, *healthy)
            return outs[:len(faulty)], outs[len(faulty):]

    (native, stream, oai, chat, batch), healthy = asyncio.run(run())
    message = "internal error: injected test fault for rid boom-native"
    assert native.status_code == 500 and native.json() == {"error": {"message": message}}
    frames = sse_frames(stream.text)
    assert stream.status_code == 200 and [f["meta_info"]["completion_tokens"] for f in frames[:-1]] == [1, 2, 3]
    assert frames[-1]["error"]["code"] == 500 and "injected test fault" in frames[-1]["error"]["message"]
    assert oai.status_code == 500 and "injected test fault" in oai.json()["message"]
    check_envelope("/v1/completions", 500, oai.json())
    assert oai.json()["type"] == "InternalServerError"
    chat_frames = sse_frames(chat.text)
    assert chat.status_code == 200 and chat_frames[-1]["error"]["code"] == 500
    assert batch.status_code == 500 and "injected test fault" in batch.json()["error"]["message"]
    assert all(r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] == 12 for r in healthy)
    three_checks(client, reference)


# ---- a KV pool far too small for the load ---------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny():
    with live_server("--max-total-tokens", "1200", "--max-running-requests", "32") as s, s.client() as c:
        yield s, c


def test_tiny_pool_32_concurrent_requests_all_finish_with_the_solo_tokens(tiny):
    srv, client = tiny
    expected = reference_ids(client)
    prompts = [f"Pool pressure prompt number {k} asks for a long answer" for k in range(4)]
    params = {**GREEDY, "max_new_tokens": 48}
    solo = [client.post("/generate", json={"text": p, "sampling_params": params}).json()["output_ids"] for p in prompts]
    client.post("/flush_cache")

    most_waiting = 0

    async def run() -> list[httpx.Response]:
        nonlocal most_waiting
        async with _client(srv.url) as c:
            bodies = [{"text": prompts[i % 4], "sampling_params": params} for i in range(32)]
            tasks = asyncio.gather(*(c.post("/generate", json=b) for b in bodies))
            while not tasks.done():
                st = (await c.get("/server_info")).json()["internal_states"][0]
                most_waiting = max(most_waiting, st["num_queue_reqs"])
                await asyncio.sleep(0.05)
            return await tasks

    t0 = time.monotonic()
    res = asyncio.run(run())
    assert time.monotonic() - t0 < 120
    assert [r.status_code for r in res] == [200] * 32
    for i, r in enumerate(res):
        assert r.json()["output_ids"] == solo[i % 4], i
        assert r.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 48}
    # 32 x (~12 + 48) tokens do not fit in 1200 slots at once: some waited or were retracted
    retractions = sum(r.json()["meta_info"]["num_retractions"] for r in res)
    assert most_waiting > 0 or retractions > 0, (most_waiting, retractions)
    print(f"tiny pool: at most {most_waiting} requests waiting, {retractions} retractions")
    three_checks(client, expected)


def test_tiny_pool_a_request_longer_than_the_pool_is_400_at_once(tiny):
    srv, client = tiny
    for path, body in (("/generate", {"input_ids": [5] * 1300}), ("/v1/completions", {"prompt": [5] * 1300}),
                       ("/generate", {"input_ids": [5] * 1200})):
        t0 = time.monotonic()
        r = client.post(path, json=body)
        assert r.status_code == 400 and time.monotonic() - t0 < 5, r.text
        check_envelope(path, 400, r.json())
        assert "does not fit in the KV cache (1200 tokens)" in r.text
    # the largest prompt that fits is served, and stops at the pool's size
    r = client.post("/generate", json={"input_ids": [5] * 1190, "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}})
    assert r.status_code == 200 and r.json()["meta_info"]["completion_tokens"] <= 10
    wait_idle(client)
    assert internal_state(client)["integrity_ok"] is True


# ---- SIGTERM under load (last: the module's server exits) ----------------------------------------------
def test_sigterm_under_mixed_load_ends_every_request_and_exits_0(srv, client, reference):
    async def run() -> list[tuple[str, int, Any]]:
        async with _client(srv.url) as c:
            async def call(kind: str, i: int) -> tuple[str, int, Any]:
                if kind == "native-stream":
                    r = await c.post("/generate", json={"text": f"t{i}", "stream": True, "sampling_params": LONG})
                    return kind, r.status_code, sse_frames(r.text)[-1]["meta_info"]["finish_reason"]["type"]
                if kind == "native":
                    r = await c.post("/generate", json={"text": f"t{i}", "sampling_params": LONG})
                    return kind, r.status_code, r.json()["meta_info"]["finish_reason"]["type"]
                if kind == "short":
                    r = await c.post("/generate", json={"text": f"s{i}", "sampling_params": {**GREEDY, "max_new_tokens": 6}})
                    return kind, r.status_code, r.json()["meta_info"]["finish_reason"]["type"]
                r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": f"t{i}"}],
                                                               "max_tokens": 3000, "ignore_eos": True, "stream": True})
                frames = sse_frames(r.text)
                return kind, r.status_code, next(ch["finish_reason"] for f in frames for ch in f["choices"]
                                                 if ch["finish_reason"])

            kinds = ["native-stream", "native", "oai-stream"] * 4 + ["short"] * 2
            tasks = [asyncio.ensure_future(call(k, i)) for i, k in enumerate(kinds)]
            await _wait_state(c, lambda st: st["num_running_reqs"] == MAX_RUNNING and st["num_queue_reqs"] > 0)
            srv.proc.send_signal(signal.SIGTERM)
            return await asyncio.wait_for(asyncio.gather(*tasks), 60)

    t0 = time.monotonic()
    results = asyncio.run(run())
    assert all(status == 200 for _, status, _ in results), results
    assert all(reason == "abort" for kind, _, reason in results if kind != "short"), results
    assert all(reason in ("length", "abort") for kind, _, reason in results if kind == "short"), results
    assert srv.proc.wait(timeout=30) == 0
    assert time.monotonic() - t0 < 45
    logs = srv.logs()
    assert "draining" in logs and "Traceback" not in logs
    assert os.path.exists(srv.log)
