"""Server-level behaviour against live servers: concurrency, disconnects, metrics, API key, SIGTERM,
start-up failures."""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engine.runtime.request import RequestOutput
from server.metrics import THROUGHPUT_WINDOW_S, Metrics
from tests.http_utils import generate, sse_frames, stream, wait_pool_idle
from tests.server_utils import ROOT, TINY, free_port, live_server, start_server

GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv():
    with live_server("--enable-metrics", "--served-model-name", "tiny-test", "--max-total-tokens", "60000") as s:
        yield s


@pytest.fixture(scope="module")
def client(srv):
    with srv.client() as c:
        yield c


async def _stream_all(url: str, bodies: list[dict]) -> list[list[dict]]:
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=httpx.Limits(max_connections=80)) as c:
        async def one(body: dict) -> list[dict]:
            r = await c.post("/generate", json={**body, "stream": True})
            assert r.status_code == 200
            return sse_frames(r.text)
        return await asyncio.gather(*(one(b) for b in bodies))


def test_64_concurrent_streams_complete_and_greedy_ones_match_solo_runs(srv, client):
    bodies = []
    for i in range(64):
        params = {**GREEDY, "max_new_tokens": 10} if i % 2 == 0 else {"temperature": 0.9, "max_new_tokens": 6 + i % 7}
        bodies.append({"text": f"Request number {i} says", "sampling_params": params})
    results = asyncio.run(_stream_all(srv.url, bodies))
    for frames in results:
        final = frames[-1]["meta_info"]
        assert final["finish_reason"]["type"] in ("length", "stop")
        assert all(f["meta_info"]["finish_reason"] is None for f in frames[:-1])
    for body, frames in list(zip(bodies, results))[::2]:
        solo = generate(client, **body)
        assert frames[-1]["output_ids"] == solo["output_ids"] and frames[-1]["text"] == solo["text"]


def test_client_disconnect_mid_stream_frees_its_slots_within_a_second(srv, client):
    body = {"text": "An endless stream", "stream": True, "sampling_params": {"max_new_tokens": 5000, "ignore_eos": True}}
    with httpx.Client(base_url=srv.url, timeout=30) as c, c.stream("POST", "/generate", json=body) as r:
        frames = 0
        for line in r.iter_lines():
            frames += line.startswith("data: ")
            if frames == 5:
                break
    assert client.get("/pools").json()["used_tokens"] > 0
    t0 = time.monotonic()
    pools = wait_pool_idle(client, timeout=1.0)
    assert pools["used_tokens"] == pools["evictable_tokens"], pools  # only unlocked prefix-cache tokens
    assert time.monotonic() - t0 < 1.0
    state = client.get("/server_info").json()["internal_states"][0]
    assert state["num_running_reqs"] == 0 and state["num_queue_reqs"] == 0


def _metrics(client) -> dict[str, float]:
    r = client.get("/metrics")
    assert r.status_code == 200
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            assert s.labels.get("model_name") == "tiny-test", s
            key = s.name + ("" if "pool" not in s.labels else f"[{s.labels['pool']}]")
            if "le" not in s.labels:
                values[key] = values.get(key, 0.0) + s.value
    return values


def test_metrics_parse_and_count_the_requests_made(srv, client):
    wait_pool_idle(client)
    before = _metrics(client)
    outs = [generate(client, text=f"metrics {i}", sampling_params={**GREEDY, "max_new_tokens": 3 + i}) for i in range(3)]
    outs += [stream(client, text=f"streamed {i}", sampling_params={**GREEDY, "max_new_tokens": 4})[-1] for i in range(2)]
    after = _metrics(client)

    def delta(name: str) -> float:
        return after[name] - before.get(name, 0.0)

    completions = sum(o["meta_info"]["completion_tokens"] for o in outs)
    assert delta("sglang:num_requests_total") == 5
    assert delta("sglang:prompt_tokens_total") == sum(o["meta_info"]["prompt_tokens"] for o in outs)
    assert delta("sglang:generation_tokens_total") == completions == 3 + 4 + 5 + 4 + 4
    assert delta("sglang:cached_tokens_total") == sum(o["meta_info"]["cached_tokens"] for o in outs)
    assert delta("sglang:num_aborted_requests_total") == 0
    assert delta("sglang:e2e_request_latency_seconds_count") == 5
    assert delta("sglang:time_to_first_token_seconds_count") == 5
    assert delta("sglang:inter_token_latency_seconds_count") == completions - 5
    assert after["sglang:num_running_reqs"] == 0 and after["sglang:num_queue_reqs"] == 0
    assert after["sglang:max_total_num_tokens"] == 60000
    assert 0 <= after["sglang:token_usage"] <= 1 and after["sglang:gen_throughput"] > 0
    assert {"sglang:pool_used_tokens[main_pool]", "sglang:pool_free_tokens[index_kv_pool]",
            "sglang:pool_bytes[index_k_pool]"} <= set(after)

    async def aborted() -> None:
        async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
            task = asyncio.ensure_future(c.post("/generate", json={
                "text": "to abort", "rid": "metrics-abort", "sampling_params": {"max_new_tokens": 3000}}))
            await asyncio.sleep(0.3)
            await c.post("/abort_request", json={"rid": "metrics-abort"})
            assert (await task).json()["meta_info"]["finish_reason"]["type"] == "abort"
    asyncio.run(aborted())
    assert _metrics(client)["sglang:num_aborted_requests_total"] - after["sglang:num_aborted_requests_total"] == 1


# ---- API key -------------------------------------------------------------------------------------------
def _all_routes() -> list[tuple[str, str]]:
    """Every (method, path) the app serves, from its OpenAPI schema plus the docs routes, path parameters
    filled in, the open probe routes (/health, /liveness) excepted."""
    from server.app import create_app
    from server.args import ServerArgs
    from server.state import ServerState

    app = create_app(ServerState(args=ServerArgs(api_key="k"), engine=None, async_engine=None))  # type: ignore[arg-type]
    routes = [(m.upper(), path) for path, item in app.openapi()["paths"].items() for m in item
              if m in ("get", "post", "put", "delete", "patch")]
    routes += [("GET", p) for p in (app.openapi_url, app.docs_url, app.redoc_url) if p]
    fill = {"{layer_id}": "0", "{buffer}": "key"}
    out = []
    for method, path in routes:
        for k, v in fill.items():
            path = path.replace(k, v)
        while "{" in path:
            start = path.index("{")
            path = path[:start] + "x" + path[path.index("}", start) + 1:]
        if path not in ("/health", "/liveness"):
            out.append((method, path))
    return out


def test_api_key_guards_every_route_but_the_probes():
    routes = _all_routes()
    paths = {p for _, p in routes}
    assert {"/generate", "/pools", "/pools/layers/0/buffers/key", "/metrics", "/server_info", "/model_info",
            "/abort_request", "/flush_cache", "/health_generate"} <= paths
    with live_server("--api-key", "sekrit", "--max-total-tokens", "4096") as s, s.client() as c:
        assert c.get("/health").status_code == c.get("/liveness").status_code == 200
        for method, path in routes:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sekrit"}):
                r = c.request(method, path, headers=headers)
                assert r.status_code == 401, (method, path, headers)
                body = r.json()
                if path.startswith("/v1/"):
                    assert body["type"] == "AuthenticationError" and body["code"] == 401 and body["message"]
                else:
                    assert set(body) == {"error"} and "API key" in body["error"]["message"]
            r = c.request(method, path, headers={"Authorization": "Bearer sekrit"})
            assert r.status_code != 401, (method, path)
        auth = {"Authorization": "Bearer sekrit"}
        ok = c.post("/generate", json={"text": "hi", "sampling_params": {"max_new_tokens": 2}}, headers=auth)
        assert ok.status_code == 200 and ok.json()["meta_info"]["completion_tokens"] == 2
        assert c.get("/metrics", headers=auth).status_code == 404  # no --enable-metrics on this server


# ---- SIGTERM and start-up failures ----------------------------------------------------------------------
def test_sigterm_under_load_finishes_or_aborts_everything_and_exits_0():
    srv = start_server("--shutdown-grace-period", "3", "--max-total-tokens", "20000")
    try:
        async def run() -> tuple[list, list, int, int]:
            async with httpx.AsyncClient(base_url=srv.url, timeout=60) as c:
                async def streamed(i: int) -> list[dict]:
                    r = await c.post("/generate", json={"text": f"long {i}", "stream": True,
                                                        "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}})
                    return sse_frames(r.text)
                long = [asyncio.ensure_future(streamed(i)) for i in range(6)]
                short = [asyncio.ensure_future(c.post("/generate", json={
                    "text": f"short {i}", "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}})) for i in range(4)]
                await asyncio.sleep(0.5)
                srv.proc.send_signal(signal.SIGTERM)
                await asyncio.sleep(0.3)
                late = await c.post("/generate", json={"text": "too late"})
                health, live = await c.get("/health"), await c.get("/liveness")
                return (await asyncio.gather(*long), await asyncio.gather(*short), late.status_code,
                        (health.status_code, live.status_code))
        long, short, late, health = asyncio.run(run())
        assert late == 503 and health == (503, 200)  # draining: not ready, but alive
        assert [r.json()["meta_info"]["finish_reason"] for r in short] == [{"type": "length", "length": 8}] * 4
        for frames in long:
            assert frames[-1]["meta_info"]["finish_reason"]["type"] == "abort"
            assert 0 < frames[-1]["meta_info"]["completion_tokens"] < 4000
        assert srv.proc.wait(timeout=30) == 0
    finally:
        if srv.proc.poll() is None:
            srv.proc.kill()
    assert "draining" in srv.logs()


def test_start_without_a_tokenizer_fails_naming_both_flags(tmp_path: Path):
    shutil.copy(Path(TINY) / "config.json", tmp_path / "config.json")  # a checkpoint with no tokenizer files
    cmd = [sys.executable, "-m", "server", "--model-path", str(tmp_path), "--load-format", "dummy",
           "--port", str(free_port())]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "--tokenizer-path" in out and "--skip-tokenizer-init" in out
    assert "Traceback" not in out
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "minimax_m3"


def test_gen_throughput_counts_the_window_only() -> None:
    """gen_throughput: the tokens generated in the last THROUGHPUT_WINDOW_S seconds over the window, as a sum of
    the outputs' deltas would give (older outputs pruned, later ones counted)."""
    m = Metrics("m", engine=None)
    m.on_submit(["a", "b"], 0.0)
    done = {"a": 0, "b": 0}
    for t, rid, n in [(1.0, "a", 3), (2.0, "b", 5), (4.0, "a", 2), (12.5, "b", 7), (13.0, "a", 1)]:
        done[rid] += n
        m.observe(RequestOutput(rid, [5] * n, "", None, done[rid], 4, 0), t)
    assert m.gen_throughput(13.0) == (2 + 7 + 1) / THROUGHPUT_WINDOW_S  # (t=1 and t=2 fell out of the window)
    assert m.gen_throughput(30.0) == 0.0
