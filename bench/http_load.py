"""HTTP clients for the server benchmarks: non-streaming requests all in flight at once, and closed-loop
streaming clients that stamp every token (SSE frames carry cumulative output_ids)."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field

import httpx
from tqdm import tqdm

from bench.workload import Request, greedy

TIMEOUT = httpx.Timeout(None, connect=30.0)


def _body(req: Request, stream: bool) -> dict:
    return {"input_ids": list(req.prompt_ids), "sampling_params": greedy(req.max_new_tokens), "stream": stream}


async def _post_all(url: str, reqs: list[Request]) -> tuple[float, int, int]:
    limits = httpx.Limits(max_connections=len(reqs) + 4, max_keepalive_connections=len(reqs) + 4)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, limits=limits) as client:
        bar = tqdm(total=len(reqs), desc="server /generate")

        async def one(req: Request) -> tuple[int, bool]:
            try:
                r = await client.post("/generate", json=_body(req, False))
                ok = r.status_code == 200
                n = r.json()["meta_info"]["completion_tokens"] if ok else 0
            except (httpx.HTTPError, ValueError, KeyError):
                n, ok = 0, False
            bar.update(1)
            return n, ok and n == req.max_new_tokens

        start = time.perf_counter()
        done = await asyncio.gather(*(one(r) for r in reqs))
        elapsed = time.perf_counter() - start
        bar.close()
    return elapsed, sum(n for n, _ in done), sum(not ok for _, ok in done)


def post_all(url: str, reqs: list[Request]) -> tuple[float, int, int]:
    """Every request as a non-streaming POST /generate, all in flight at once; (seconds, tokens, errors)."""
    return asyncio.run(_post_all(url, reqs))


@dataclass
class StreamStats:
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)  # per token (a frame carrying k tokens: k gaps of gap/k)
    tokens: int = 0
    errors: list[str] = field(default_factory=list)


async def _stream_one(client: httpx.AsyncClient, req: Request, stats: StreamStats) -> None:
    start = time.perf_counter()
    last, seen, final = start, 0, None
    try:
        async with client.stream("POST", "/generate", json=_body(req, True)) as r:
            if r.status_code != 200:
                stats.errors.append(f"HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                payload = line[len("data: "):]
                if payload == "[DONE]":
                    break
                frame = json.loads(payload)
                if "error" in frame:
                    stats.errors.append(f"error frame: {str(frame['error'])[:200]}")
                    return
                now, n = time.perf_counter(), len(frame.get("output_ids", []))
                if n > seen:
                    if seen == 0:
                        stats.ttft_s.append(now - start)
                    else:
                        stats.itl_s.extend([(now - last) / (n - seen)] * (n - seen))
                    seen, last = n, now
                final = frame
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        stats.errors.append(f"{type(e).__name__}: {e}")
        return
    stats.tokens += seen
    if final is None or seen != req.max_new_tokens:
        stats.errors.append(f"got {seen} of {req.max_new_tokens} tokens")


async def _closed_loop(url: str, reqs: list[Request], clients: int) -> tuple[float, StreamStats]:
    queue: asyncio.Queue[Request] = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    stats = StreamStats()
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(base_url=url, timeout=TIMEOUT, limits=limits) as client:
        bar = tqdm(total=len(reqs), desc=f"{clients} streaming clients")

        async def worker() -> None:
            while not queue.empty():
                req = queue.get_nowait()
                await _stream_one(client, req, stats)
                bar.update(1)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        elapsed = time.perf_counter() - start
        bar.close()
    return elapsed, stats


def stream_closed_loop(url: str, reqs: list[Request], clients: int) -> tuple[float, StreamStats]:
    """`clients` concurrent streaming clients, each taking the next request when its last one ends."""
    return asyncio.run(_closed_loop(url, reqs, clients))
