"""Shared checks for the reliability and security tests: error envelopes and the three after-scenario checks.

After every fault scenario the same three things must hold (docs/reliability.md):
  (i)   pool integrity: `/server_info` internal_states[0].integrity_ok (Engine.check_integrity on the
        engine thread between steps: free + owned + prefix-cached slots == pool size, no slot owned twice);
  (ii)  once idle, `GET /pools` shows no token held by a request (used == evictable: only the prefix
        cache's unlocked tokens), and zero used tokens after `POST /flush_cache`;
  (iii) a fixed greedy request returns exactly the tokens it returned before the scenario.
"""

from __future__ import annotations

import time
from typing import Any

import httpx

REFERENCE = {"text": "The reference request of the reliability tests", "sampling_params": {
    "temperature": 0, "max_new_tokens": 12, "ignore_eos": True}}


def check_envelope(path: str, status: int, body: Any) -> None:
    """A 4xx/5xx body is in the envelope of its route: native `{"error": {"message"}}`, /v1 OpenAI's flat one."""
    if path.startswith("/v1/models/") and status == 404:  # http_api.md §3: OpenAI's model_not_found shape
        assert set(body) == {"error"} and body["error"]["code"] == "model_not_found", body
        return
    if path.startswith("/v1/"):
        assert isinstance(body, dict) and set(body) == {"object", "message", "type", "param", "code"}, body
        assert body["object"] == "error" and body["code"] == status, body
        assert isinstance(body["message"], str) and body["message"] and isinstance(body["type"], str), body
    else:
        assert isinstance(body, dict) and set(body) == {"error"}, body
        assert isinstance(body["error"], dict) and isinstance(body["error"].get("message"), str), body
        assert body["error"]["message"], body


def internal_state(client: httpx.Client) -> dict[str, Any]:
    return client.get("/server_info").json()["internal_states"][0]


def wait_idle(client: httpx.Client, timeout: float = 20.0) -> dict[str, Any]:
    """Wait until nothing is queued, running or in flight, and no request holds KV slots."""
    deadline = time.monotonic() + timeout
    while True:
        st = internal_state(client)
        pools = client.get("/pools").json()
        idle = (st["num_running_reqs"] == 0 and st["num_queue_reqs"] == 0 and st["num_in_flight"] == 0
                and pools["used_tokens"] == pools["evictable_tokens"])
        if idle:
            return pools
        assert time.monotonic() < deadline, f"server not idle after {timeout}s: {st} {pools}"
        time.sleep(0.05)


def reference_ids(client: httpx.Client) -> list[int]:
    r = client.post("/generate", json=REFERENCE)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def three_checks(client: httpx.Client, expected_ids: list[int], timeout: float = 20.0) -> None:
    """(i) integrity, (ii) no leaked tokens once idle and none after a flush, (iii) the same greedy tokens."""
    pools = wait_idle(client, timeout)
    assert internal_state(client)["integrity_ok"] is True
    assert pools["used_tokens"] == pools["evictable_tokens"], pools
    r = client.post("/flush_cache")
    assert r.status_code == 200, r.text
    pools = client.get("/pools").json()
    assert pools["used_tokens"] == 0 and pools["free_tokens"] == pools["size_tokens"], pools
    assert reference_ids(client) == expected_ids
    wait_idle(client, timeout)
    assert internal_state(client)["integrity_ok"] is True
