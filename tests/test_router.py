"""Two of our workers behind SGLang's own router (`sglang-router`, the Rust gateway) on loopback ports.

Native and OpenAI requests, streaming too, reach both workers through the router; the router reads
each worker's load from its GET /get_load; with one worker killed the other serves every new request;
a worker restarted on the same port comes back into rotation. Every wait is time-bound.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.server_utils import LiveServer, free_port, start_server

ROUTER = Path(sys.executable).with_name("sglang-router")
SAMPLING = {"max_new_tokens": 6, "temperature": 0}


def _until(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if out := check():
                return out
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


class Cluster:
    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.workers: list[LiveServer] = [self.start_worker() for _ in range(2)]
        self.urls = [w.url for w in self.workers]
        self.url = f"http://127.0.0.1:{free_port()}"
        self.log = logs / "router.log"
        cmd = [str(ROUTER), "launch", "--worker-urls", *self.urls, "--host", "127.0.0.1",
               "--port", self.url.rsplit(":", 1)[1], "--policy", "round_robin", "--disable-circuit-breaker",
               "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
               "--worker-startup-timeout-secs", "60", "--request-timeout-secs", "60", "--log-level", "warn"]
        self.router = subprocess.Popen(cmd, stdout=self.log.open("w"), stderr=subprocess.STDOUT)
        _until(lambda: httpx.get(self.url + "/v1/models", timeout=2).status_code == 200, 60, "the router")

    def start_worker(self, port: int | None = None) -> LiveServer:
        return start_server("--served-model-name", "tiny", log_dir=self.logs, port=port)

    def generate(self, **body) -> httpx.Response:
        return httpx.post(self.url + "/generate", json={"text": "Once upon a time", "sampling_params": SAMPLING,
                                                        **body}, timeout=60)

    def close(self) -> None:
        self.router.terminate()
        self.router.wait(timeout=30)
        for w in self.workers:
            w.terminate()


def served(worker: LiveServer) -> int:
    """Requests this worker finished: its access-log lines (one per request, every route)."""
    return worker.logs().count(" rid=")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    if not ROUTER.exists():
        pytest.fail(f"{ROUTER} missing: sglang-router is in the test extra (pip install -e '.[test]')")
    c = Cluster(tmp_path_factory.mktemp("router"))
    try:
        yield c
    finally:
        c.close()


def test_native_and_openai_requests_reach_both_workers(cluster):
    before = [served(w) for w in cluster.workers]
    for _ in range(4):
        out = cluster.generate()
        assert out.status_code == 200, out.text
        assert 0 < out.json()["meta_info"]["completion_tokens"] <= SAMPLING["max_new_tokens"]
    with httpx.stream("POST", cluster.url + "/generate", timeout=60,
                      json={"text": "The cat", "sampling_params": SAMPLING, "stream": True}) as r:
        frames = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and frames[-1] == "data: [DONE]"
    assert json.loads(frames[-2][6:])["meta_info"]["finish_reason"] is not None
    for _ in range(2):
        c = httpx.post(cluster.url + "/v1/completions", timeout=60,
                       json={"model": "tiny", "prompt": "A dog", "max_tokens": 5, "temperature": 0})
        assert c.status_code == 200 and c.json()["usage"]["completion_tokens"] > 0, c.text
        chat = httpx.post(cluster.url + "/v1/chat/completions", timeout=60,
                          json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5})
        assert chat.status_code == 200 and chat.json()["choices"][0]["message"]["role"] == "assistant", chat.text
    with httpx.stream("POST", cluster.url + "/v1/chat/completions", timeout=60,
                      json={"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5,
                            "stream": True}) as r:
        chunks = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.status_code == 200 and chunks[-1] == "data: [DONE]" and len(chunks) >= 3
    time.sleep(0.5)  # the access-log line is written as the response ends
    gained = [served(w) - b for w, b in zip(cluster.workers, before)]
    assert sum(gained) == 4 + 1 + 2 + 2 + 1 and min(gained) >= 3, gained


def test_the_router_reads_each_workers_load_and_names(cluster):
    """The router's load view comes from GET /get_load (-1 when a worker has none); it sees the served
    model name and the worker's absolute model path (a relative one made it look for a hub model)."""
    busy = cluster.workers[0]
    body = {"text": "Once", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}
    with ThreadPoolExecutor(4) as pool:
        jobs = [pool.submit(httpx.post, busy.url + "/generate", json=body, timeout=120) for _ in range(4)]

        def loaded():
            view = {e["worker"]: e["load"] for e in httpx.get(cluster.url + "/get_loads", timeout=5).json()["workers"]}
            own = httpx.get(busy.url + "/get_load", timeout=5).json()
            return view if view[busy.url] > 0 and own[0]["num_reqs"] > 0 else None

        view = _until(loaded, 60, "the router to see the busy worker's load")
        assert set(view) == set(cluster.urls) and all(v >= 0 for v in view.values()), view
        assert all(j.result().status_code == 200 for j in jobs)
    idle = httpx.get(busy.url + "/get_load", timeout=5).json()
    assert idle == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": idle[0]["num_tokens"]}]
    workers = httpx.get(cluster.url + "/workers", timeout=5).json()["workers"]
    assert {w["model_id"] for w in workers} == {"tiny"}
    assert all(Path(w["metadata"]["model_path"]).is_absolute() for w in workers), workers


def test_a_killed_worker_is_routed_around_and_a_restarted_one_rejoins(cluster):
    dead = cluster.workers[0]
    port = int(dead.url.rsplit(":", 1)[1])
    dead.proc.kill()
    dead.proc.wait(timeout=30)
    alive_before = served(cluster.workers[1])
    for _ in range(6):
        out = cluster.generate()
        assert out.status_code == 200, out.text
    time.sleep(0.5)
    assert served(cluster.workers[1]) - alive_before == 6
    cluster.workers[0] = cluster.start_worker(port=port)

    def rejoined() -> bool:
        assert cluster.generate().status_code == 200
        return served(cluster.workers[0]) > 0

    _until(rejoined, 60, "the restarted worker to get traffic again")
