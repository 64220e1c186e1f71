"""Helpers for the HTTP tests: SSE parsing, concurrent requests, waiting for the pool to settle."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import httpx


def sse_frames(raw: str) -> list[dict[str, Any]]:
    """Parse a whole SSE body: only `data: ` events, blank-line separated, ending with [DONE]."""
    events = raw.split("\n\n")
    assert events[-1] == "", f"body does not end with a blank line: {raw[-80:]!r}"
    payloads = []
    for ev in events[:-1]:
        assert ev.startswith("data: ") and "\n" not in ev, f"bad SSE event {ev[:120]!r}"
        payloads.append(ev[len("data: "):])
    assert payloads and payloads[-1] == "[DONE]", "stream does not end with data: [DONE]"
    assert "[DONE]" not in payloads[:-1]
    return [json.loads(p) for p in payloads[:-1]]


def generate(client: httpx.Client, **body: Any) -> Any:
    r = client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(client: httpx.Client, **body: Any) -> list[dict[str, Any]]:
    r = client.post("/generate", json={**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    return sse_frames(r.text)


async def _post_all(url: str, bodies: list[dict[str, Any]], timeout: float) -> list[httpx.Response]:
    limits = httpx.Limits(max_connections=len(bodies) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as c:
        return await asyncio.gather(*(c.post("/generate", json=b) for b in bodies))


def post_concurrently(url: str, bodies: list[dict[str, Any]], timeout: float = 120) -> list[httpx.Response]:
    """POST every body to /generate at once; responses in the same order."""
    return asyncio.run(_post_all(url, bodies, timeout))


def wait_pool_idle(client: httpx.Client, timeout: float = 5.0) -> dict[str, Any]:
    """Wait until no request holds KV slots (every used slot is an unlocked prefix-cache slot)."""
    deadline = time.monotonic() + timeout
    while True:
        pools = client.get("/pools").json()
        if pools["used_tokens"] == pools["evictable_tokens"] or time.monotonic() > deadline:
            return pools
        time.sleep(0.05)
