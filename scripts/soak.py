"""Soak test: minutes of mixed load against a live server; fails on any error or on memory growth.

    python scripts/soak.py [--duration 600] [--warmup 60] [--workers 8] [--max-growth 0.10]

Starts `python -m server` (configs/tiny) on a free loopback port and runs `--workers` clients that
loop over a seeded mix: native /generate plain, streamed and batched (n=2), /v1/completions and
/v1/chat/completions plain and streamed, aborts by rid, and clients that disconnect mid-stream, with
varied prompt and output lengths. Resident memory (VmRSS of the server process, from /proc) is sampled
every few seconds; growth = (mean of the last 30 s) / (mean of the 30 s after warm-up) - 1.

At the end: the server must be idle with no request holding KV slots, pass its integrity check, drop
to zero used tokens after /flush_cache, give the same greedy tokens as at the start, and exit 0 on
SIGTERM. It prints the figures (and one JSON line), and exits 1 if errors > 0 or growth >= --max-growth.
Not part of pytest or CI: `make soak`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = {"text": "The soak test's reference request", "sampling_params": {"temperature": 0, "max_new_tokens": 16,
                                                                               "ignore_eos": True}}
WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly judge boxing matches".split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def start_server(port: int, extra: list[str], log: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "server", "--port", str(port), "--model-path", str(ROOT / "configs" / "tiny"), *extra]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log.open("w"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit(f"server did not become healthy; see {log}")


def sse_payloads(text: str) -> list[dict]:
    events = [e for e in text.split("\n\n") if e]
    if not events or events[-1] != "data: [DONE]":
        raise AssertionError(f"stream does not end with [DONE]: {text[-200:]!r}")
    out = []
    for e in events[:-1]:
        if not e.startswith("data: "):
            raise AssertionError(f"bad SSE event {e[:100]!r}")
        out.append(json.loads(e[6:]))
    if any("error" in p for p in out):
        raise AssertionError(f"error frame: {out[-1]}")
    return out


class Soak:
    def __init__(self, url: str, seed: int) -> None:
        self.url = url
        self.rng = random.Random(seed)
        self.ok: Counter[str] = Counter()
        self.errors: Counter[str] = Counter()
        self.examples: list[str] = []
        self.rid = 0

    def prompt(self) -> str:
        n = int(self.rng.choice([1, 3, 8, 20, 60, 150, 400]) * self.rng.uniform(0.5, 1.5)) + 1
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def new_tokens(self) -> int:
        return self.rng.choice([1, 2, 4, 8, 16, 32, 64, 128])

    async def one(self, c: httpx.AsyncClient) -> None:
        kind = self.rng.choice(["native", "native_stream", "native_batch", "completions", "completions_stream",
                                "chat", "chat_stream", "abort", "disconnect"])
        try:
            await getattr(self, kind)(c)
            self.ok[kind] += 1
        except Exception as e:  # noqa: BLE001 - every failure is counted and shown
            self.errors[kind] += 1
            if len(self.examples) < 20:
                self.examples.append(f"{kind}: {type(e).__name__}: {str(e)[:300]}")

    def params(self) -> dict:
        p = {"max_new_tokens": self.new_tokens(), "temperature": self.rng.choice([0, 0.7, 1.0])}
        if self.rng.random() < 0.5:
            p["ignore_eos"] = True
        return p

    async def native(self, c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"text": self.prompt(), "sampling_params": self.params()})
        assert r.status_code == 200, r.text[:300]
        assert r.json()["meta_info"]["finish_reason"]["type"] in ("length", "stop")

    async def native_stream(self, c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"text": self.prompt(), "stream": True, "sampling_params": self.params(),
                                            "return_logprob": self.rng.random() < 0.3})
        assert r.status_code == 200, r.text[:300]
        assert sse_payloads(r.text)[-1]["meta_info"]["finish_reason"]["type"] in ("length", "stop")

    async def native_batch(self, c: httpx.AsyncClient) -> None:
        r = await c.post("/generate", json={"text": [self.prompt(), self.prompt()],
                                            "sampling_params": {**self.params(), "n": 2, "temperature": 0.8}})
        assert r.status_code == 200 and len(r.json()) == 4, r.text[:300]

    async def completions(self, c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"prompt": self.prompt(), "max_tokens": self.new_tokens(),
                                                  "logprobs": self.rng.choice([None, 2])})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text[:300]

    async def completions_stream(self, c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/completions", json={"prompt": self.prompt(), "max_tokens": self.new_tokens(),
                                                  "stream": True, "stream_options": {"include_usage": True}})
        assert r.status_code == 200, r.text[:300]
        assert sse_payloads(r.text)[-1]["usage"]["completion_tokens"] >= 1

    async def chat(self, c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": self.prompt()}],
                                                       "max_tokens": self.new_tokens()})
        assert r.status_code == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop"), r.text[:300]

    async def chat_stream(self, c: httpx.AsyncClient) -> None:
        r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": self.prompt()}],
                                                       "max_tokens": self.new_tokens(), "stream": True})
        assert r.status_code == 200, r.text[:300]
        assert any(ch.get("finish_reason") for f in sse_payloads(r.text) for ch in f["choices"])

    async def abort(self, c: httpx.AsyncClient) -> None:
        self.rid += 1
        rid = f"soak-abort-{self.rid}"
        task = asyncio.ensure_future(c.post("/generate", json={
            "text": self.prompt(), "rid": rid, "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}))
        await asyncio.sleep(self.rng.uniform(0.0, 1.5))
        r = await c.post("/abort_request", json={"rid": rid})
        assert r.status_code == 200, r.text[:300]
        res = await task
        assert res.status_code == 200 and res.json()["meta_info"]["finish_reason"]["type"] == "abort", res.text[:300]

    async def disconnect(self, c: httpx.AsyncClient) -> None:
        frames, stop_after = 0, self.rng.randint(1, 10)
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as own:
            body = {"text": self.prompt(), "stream": True, "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
            async with own.stream("POST", "/generate", json=body) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    frames += line.startswith("data: ")
                    if frames >= stop_after:
                        break


async def drive(soak: Soak, workers: int, until: float) -> None:
    async with httpx.AsyncClient(base_url=soak.url, timeout=300, limits=httpx.Limits(max_connections=workers * 2)) as c:
        async def worker() -> None:
            while time.monotonic() < until:
                await soak.one(c)
        await asyncio.gather(*(worker() for _ in range(workers)))


async def sample_rss(pid: int, until: float, samples: list[tuple[float, float]], t0: float, every: float) -> None:
    while time.monotonic() < until:
        samples.append((time.monotonic() - t0, rss_mib(pid)))
        await asyncio.sleep(every)


def wait_idle(c: httpx.Client, timeout: float = 60) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        st = c.get("/server_info").json()["internal_states"][0]
        pools = c.get("/pools").json()
        if st["num_running_reqs"] == st["num_queue_reqs"] == st["num_in_flight"] == 0 and \
                pools["used_tokens"] == pools["evictable_tokens"]:
            return {**st, **{"used_tokens": pools["used_tokens"], "evictable_tokens": pools["evictable_tokens"]}}
        if time.monotonic() > deadline:
            raise AssertionError(f"not idle after {timeout}s: {st} {pools}")
        time.sleep(0.1)


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=600, help="seconds of load (default 600)")
    ap.add_argument("--warmup", type=float, default=60, help="seconds before the RSS baseline (default 60)")
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--max-growth", type=float, default=0.10, help="fail at this RSS growth or more (default 0.10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sample-every", type=float, default=5.0)
    ap.add_argument("--log", default="/tmp/soak-server.log")
    ap.add_argument("--server-args", default="--max-total-tokens 30000 --max-running-requests 16 --context-length 4096")
    args = ap.parse_args()

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start_server(port, args.server_args.split(), Path(args.log))
    problems: list[str] = []
    try:
        with httpx.Client(base_url=url, timeout=120) as c:
            ref = c.post("/generate", json=REFERENCE).json()["output_ids"]
            soak = Soak(url, args.seed)
            t0 = time.monotonic()
            samples: list[tuple[float, float]] = []
            print(f"soak: {args.duration:.0f}s of mixed load, {args.workers} workers, server pid {proc.pid} on {url}",
                  flush=True)

            async def run() -> None:
                until = t0 + args.duration
                await asyncio.gather(drive(soak, args.workers, until),
                                     sample_rss(proc.pid, until, samples, t0, args.sample_every))
            asyncio.run(run())
            elapsed = time.monotonic() - t0
            idle = wait_idle(c)
            if idle.get("integrity_ok") is not True:
                problems.append(f"integrity check failed: {idle}")
            if c.post("/flush_cache").status_code != 200 or c.get("/pools").json()["used_tokens"] != 0:
                problems.append("flush_cache did not empty the pool")
            if c.post("/generate", json=REFERENCE).json()["output_ids"] != ref:
                problems.append("the reference greedy request changed its tokens")
            samples.append((time.monotonic() - t0, rss_mib(proc.pid)))
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=60)
    if code != 0:
        problems.append(f"server exit code {code} after SIGTERM")

    base = [r for t, r in samples if args.warmup <= t < args.warmup + 30] or [samples[0][1]]
    last = [r for t, r in samples if t >= samples[-1][0] - 30]
    growth = mean(last) / mean(base) - 1
    requests = sum(soak.ok.values()) + sum(soak.errors.values())
    errors = sum(soak.errors.values())
    print(f"duration      {elapsed:.0f} s")
    print(f"requests      {requests} ({requests / elapsed:.1f}/s)  by kind: {dict(sorted(soak.ok.items()))}")
    print(f"errors        {errors}  {dict(soak.errors)}")
    for ex in soak.examples:
        print(f"  {ex}")
    print(f"rss           start {samples[0][1]:.1f} MiB, after warm-up {mean(base):.1f} MiB, end {mean(last):.1f} MiB, "
          f"max {max(r for _, r in samples):.1f} MiB")
    print(f"rss growth    {growth * 100:+.2f}% after warm-up (limit {args.max_growth * 100:.0f}%)")
    print(f"end checks    {'ok' if not problems else problems}")
    print("SOAK_RESULT " + json.dumps({"duration_s": round(elapsed, 1), "requests": requests, "errors": errors,
                                       "errors_by_kind": dict(soak.errors), "ok_by_kind": dict(soak.ok),
                                       "rss_start_mib": round(samples[0][1], 1), "rss_baseline_mib": round(mean(base), 1),
                                       "rss_end_mib": round(mean(last), 1), "rss_growth": round(growth, 4),
                                       "end_checks": problems or "ok", "exit_code": code}))
    failed = errors > 0 or growth >= args.max_growth or problems
    print("SOAK FAILED" if failed else "SOAK PASSED")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
