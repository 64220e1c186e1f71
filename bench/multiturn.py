"""`make bench-multiturn`: a bench_multiturn-style workload against the server with the hierarchical KV cache off
and on, in one run: both servers up, the workload run on them round by round in turn, twice, each time from an
empty cache; each figure pools a server's passes. N clients, R rounds with a barrier between them; in each round
every client sends, in a random order, its whole conversation so far plus L new tokens and asks for o greedy tokens
(streamed). The conversations together hold about 4x the device pool, one of them fits in it. Then, offline: a
retraction forced with the tier on (tokens recomputed), and the disk tier against recomputing, per prompt length.
Writes docs/benchmarks/multiturn.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import tempfile
import time
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, ExitStack, aclosing
from pathlib import Path

import httpx

from bench.ours import make_engine, timed_generate
from bench.timing import percentile, ratio
from bench.workload import greedy
from engine.runtime.engine import Engine
from tests.engine_utils import forced_retraction as retracted_and_recomputed
from tests.server_utils import live_server

ROOT = Path(__file__).resolve().parents[1]
MODEL = str(ROOT / "configs" / "tiny")


async def turn(client: httpx.AsyncClient, ids: list[int], out: int) -> dict:
    """One streamed greedy turn: TTFT, per-token gaps after it, output ids, cached prompt tokens."""
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": out, "temperature": 0, "ignore_eos": True}}
    start, last, seen, gaps, frame, ttft = time.perf_counter(), 0.0, 0, [], {}, float("nan")
    async with client.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            frame, now = json.loads(line[6:]), time.perf_counter()
            n = len(frame["output_ids"])
            if n > seen:
                ttft = now - start if seen == 0 else ttft
                gaps += [(now - last) / (n - seen)] * (n - seen) if seen else []
                seen, last = n, now
    return {"ttft": ttft, "gaps": gaps, "output_ids": frame["output_ids"], "prompt": len(ids),
            "cached": frame["meta_info"]["cached_tokens"], "end": time.perf_counter()}


async def conversations(url: str, a: argparse.Namespace) -> AsyncIterator[list[dict]]:
    """Each round's turns, round by round (each with its client and the most its prompt could have found cached)."""
    rng = random.Random(a.seed)
    history: dict[int, list[int]] = {c: [] for c in range(a.clients)}
    computed = dict.fromkeys(history, 0)  # tokens of each conversation the server has computed
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        for _ in range(a.rounds):
            order = rng.sample(range(a.clients), a.clients)
            prompts = {c: history[c] + [rng.randrange(5, 4000) for _ in range(a.new)] for c in order}
            done = await asyncio.gather(*(turn(client, prompts[c], a.out) for c in order))
            for c, res in zip(order, done):
                res.update(client=c, ceiling=computed[c])
                history[c] = prompts[c] + res["output_ids"]
                computed[c] = len(history[c]) - 1  # (the last output token is never fed back)
            info = (await client.get("/server_info")).json()
            assert info["internal_states"][0]["integrity_ok"], "the KV cache failed its integrity check"
            yield done


async def alone(url: str, ids: list[int], out: int) -> float:
    """Decode time per token with nothing else running: one request's median gap between two tokens (taken after
    the conversations, the two servers in turn). (The gaps in the conversations also hold other requests' prefill
    steps, far more of them with the tier off.)"""
    async with httpx.AsyncClient(base_url=url, timeout=None) as client:
        return statistics.median((await turn(client, ids, out))["gaps"])


def rss(pid: int) -> int:
    return int(re.search(r"VmRSS:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text()).group(1)) * 1024


def flags(a: argparse.Namespace, tier: bool) -> list[str]:
    out = ["--model-path", MODEL, "--max-total-tokens", str(a.pool), "--max-running-requests", str(a.clients),
           "--log-level", "warning", "--enable-metrics", "--dtype", "float32", "--device", "cpu",
           "--cuda-graph-max-bs", str(a.clients)]  # (decode graphs as a server runs; the tests' servers run eager)
    return out + (["--enable-hierarchical-cache", "--hicache-size", str(a.hicache_gb), "--hicache-write-policy",
                   a.policy] if tier else [])


def serve(a: argparse.Namespace, servers: list) -> list[dict]:
    """One pass of the conversations against each server, from an empty cache, in lockstep: a round on one, then the
    same round on the next (the others idle), so that each round's figures of all servers see the same stretch of
    this machine's speed, which drifts by 10-35% within a minute."""
    rss_before = []
    for srv in servers:
        with srv.client() as c:
            warm = [random.Random(1).randrange(5, 4000) for _ in range(300)]
            c.post("/generate", json={"input_ids": warm, "sampling_params": {"max_new_tokens": 4}})
            c.post("/flush_cache")
            rss_before.append(rss(srv.proc.pid))

    async def rounds() -> tuple[list[list[list[dict]]], list[float]]:
        done, seconds = [[] for _ in servers], [0.0] * len(servers)
        async with AsyncExitStack() as stack:  # (each server's client closed when its conversations are done)
            runs = [await stack.enter_async_context(aclosing(conversations(s.url, a))) for s in servers]
            for _ in range(a.rounds):
                for i, run in enumerate(runs):
                    start = time.perf_counter()
                    done[i].append(await anext(run))
                    seconds[i] += time.perf_counter() - start
        return done, seconds

    done, seconds = asyncio.run(rounds())
    out = []
    for srv, r, sec, before in zip(servers, done, seconds, rss_before):
        with srv.client() as c:
            pools, metrics = c.get("/pools").json(), c.get("/metrics").text
        out.append({"rounds": r, "seconds": sec, "rss_before": before, "rss_after": rss(srv.proc.pid), "pools": pools,
                    "metrics": metrics})
    return out


def summary(passes: list[dict]) -> dict:
    """One server's figures over all of its passes (each turn of each pass counted once)."""
    rounds = [[t for p in passes for t in p["rounds"][r]] for r in range(len(passes[0]["rounds"]))]
    turns, returning = [t for r in rounds for t in r], [t for r in rounds[1:] for t in r]
    seconds = sum(p["seconds"] for p in passes)
    last = passes[-1]
    hits = {m[0]: float(m[1]) for m in re.findall(r'sglang:cache_hit_tokens_total\{.*tier="(\w+)"\} (\S+)',
                                                  last["metrics"])}
    outputs = [[t["output_ids"] for r in p["rounds"] for t in sorted(r, key=lambda t: t["client"])] for p in passes]
    assert all(o == outputs[0] for o in outputs), "two passes of one server gave different greedy tokens"
    return {
        "passes": len(passes), "seconds": seconds, "output_tok_s": sum(len(t["output_ids"]) for t in turns) / seconds,
        "requests_s": len(turns) / seconds,
        "round0_ttft_mean_s": statistics.mean(t["ttft"] for t in rounds[0]),
        "returning_ttft_mean_s": statistics.mean(t["ttft"] for t in returning),
        "returning_ttft_p90_s": percentile([t["ttft"] for t in returning], 90),
        "returning_ttft_mean_s_by_pass": [statistics.mean(t["ttft"] for r in p["rounds"][1:] for t in r)
                                          for p in passes],
        "itl_median_s": statistics.median(g for t in turns for g in t["gaps"]),
        "itl_mean_s": statistics.mean(g for t in turns for g in t["gaps"]),
        "hit_rate_by_round": [sum(t["cached"] for t in r) / sum(t["prompt"] for t in r) for r in rounds],
        "ceiling_by_round": [sum(t["ceiling"] for t in r) / sum(t["prompt"] for t in r) for r in rounds],
        "hit_of_ceiling": sum(t["cached"] for t in returning) / sum(t["ceiling"] for t in returning),
        # (the server's lifetime counters, /flush_cache does not reset them: every pass and the warm-up requests)
        "hit_tokens_by_tier_all_passes": hits, "host_tier": last["pools"]["host_tier"],
        "rss_growth_bytes": last["rss_after"] - passes[0]["rss_before"],
        "device_leak_free": last["pools"]["used_tokens"] == last["pools"]["evictable_tokens"],
        "outputs": outputs[0],
    }


def engine(**kw) -> Engine:
    return make_engine(Path(MODEL), disable_cuda_graph=True, **kw)


def first_token_s(e: Engine, ids: list[int]) -> tuple[float, int]:
    """Seconds from submission to the first token, offline; and the prompt tokens found cached."""
    run = timed_generate(e, ids, 1, greedy)
    return run.token_times[0] - run.start, run.cached_tokens


def forced_retraction() -> dict:
    """Six requests that cannot all decode in 1,500 slots: the retracted ones, and the tokens they recomputed."""
    e = engine(max_total_tokens=1500, enable_hierarchical_cache=True, max_running_requests=8)
    recomputed = retracted_and_recomputed(e)
    assert e.check_integrity()
    return {"retracted_requests": len(recomputed), "tokens_recomputed": sum(recomputed.values())}


def disk_against_recompute(lengths: list[int]) -> list[dict]:
    """Per prompt length: the first token with the prefix recomputed, and read from disk pages by a new server."""
    rows = []
    with tempfile.TemporaryDirectory() as d:
        disk = dict(enable_hierarchical_cache=True, hicache_storage_backend="file", hicache_storage_dir=d)
        writer, off = engine(**disk), engine()
        for n in lengths:
            ids = [random.Random(n).randrange(5, 4000) for _ in range(n + 1)]
            first_token_s(writer, ids)
            recompute, _ = first_token_s(off, ids)
            off.flush_cache()
            reader = engine(**disk)
            read, cached = first_token_s(reader, ids)
            rows.append({"prompt": n + 1, "recompute_s": recompute, "disk_s": read, "from_disk": cached,
                         "disk_over_recompute": ratio(read, recompute)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=16)
    p.add_argument("--new", type=int, default=112, help="new tokens per turn (L)")
    p.add_argument("--out", type=int, default=16, help="output tokens per turn (o)")
    p.add_argument("--pool", type=int, default=4096, help="device KV pool in tokens")
    p.add_argument("--hicache-gb", type=float, default=0.12)
    p.add_argument("--policy", default="write_through")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--passes", type=int, default=2, help="passes of the whole workload (each server, round by round)")
    p.add_argument("--json", default=str(ROOT / "docs" / "benchmarks" / "multiturn.json"))
    a = p.parse_args()
    total = a.clients * a.rounds * (a.new + a.out)
    print(f"{a.clients} clients x {a.rounds} rounds x ({a.new} + {a.out}) tokens: {total} in all = "
          f"{total / a.pool:.1f}x the {a.pool}-token device pool; one conversation {total // a.clients}")
    with ExitStack() as stack:  # (both servers up; the idle one sleeps in a blocking wait)
        servers = [stack.enter_context(live_server(*flags(a, tier), wait=600)) for tier in (False, True)]
        passes = [serve(a, servers) for _ in range(a.passes)]
        off, on = summary([p[0] for p in passes]), summary([p[1] for p in passes])
        alone_ms: list[list[float]] = [[], []]
        for _ in range(4):  # (interleaved: the two servers' figures on the same machine states)
            for i, srv in enumerate(servers):
                alone_ms[i].append(asyncio.run(alone(srv.url, list(range(5, 1029)), 64)))
        off["decode_s_per_token"], on["decode_s_per_token"] = min(alone_ms[0]), min(alone_ms[1])
    assert off.pop("outputs") == on.pop("outputs"), "tier on and off gave different greedy tokens"
    r = {k: ratio(on[k], off[k]) for k in ("returning_ttft_mean_s", "returning_ttft_p90_s", "round0_ttft_mean_s",
                                           "output_tok_s", "decode_s_per_token")}
    host_bytes = on["host_tier"]["total_bytes"]
    # NOTE: each server's whole RSS growth over its passes, prefill buffers included: the tier-off one grows by its
    # longer prefills' buffers (~120 MB) and the tier-on one by its host tier (all of it once full) and its shorter
    # prefills' buffers, so the target asks that the tier add at most its size to what the tier-off server grows by
    rss_growth = on["rss_growth_bytes"]
    out = {"params": vars(a), "tier_off": off, "tier_on": on, "on_over_off": r,
           "host_tier_bytes": host_bytes, "rss_growth_bytes": rss_growth,
           "forced_retraction": forced_retraction(), "disk_against_recompute": disk_against_recompute(
               [64, 256, 1024, 4096])}
    targets = [("returning TTFT mean on/off <= 0.3", r["returning_ttft_mean_s"] <= 0.3),
               ("returning TTFT p90 on/off <= 0.4", r["returning_ttft_p90_s"] <= 0.4),
               ("throughput on/off >= 2", r["output_tok_s"] >= 2),
               ("hit tokens >= 0.95 of the ceiling", on["hit_of_ceiling"] >= 0.95),
               ("round-0 TTFT on/off <= 1.10", r["round0_ttft_mean_s"] <= 1.10),
               ("decode time per token alone within 5%", abs(r["decode_s_per_token"] - 1) <= 0.05),
               ("forced retraction recomputes 0 tokens", out["forced_retraction"]["tokens_recomputed"] == 0),
               ("tier-on RSS growth <= --hicache-size + tier-off's", rss_growth <= a.hicache_gb * 1e9
                                                                       + off["rss_growth_bytes"]),
               ("no leaked slot (device, host)", on["device_leak_free"] and off["device_leak_free"])]
    out["targets"] = {name: ok for name, ok in targets}
    for name, key in (("tier off", "tier_off"), ("tier on", "tier_on")):
        d = out[key]
        print(f"{name:8s}: {d['passes']} passes, {d['seconds']:6.1f} s, {d['output_tok_s']:6.1f} tok/s, TTFT round 0 "
              f"{d['round0_ttft_mean_s'] * 1e3:6.0f} ms, returning mean {d['returning_ttft_mean_s'] * 1e3:6.0f} ms ("
              f"{' / '.join(f'{m * 1e3:.0f}' for m in d['returning_ttft_mean_s_by_pass'])} by pass) p90 "
              f"{d['returning_ttft_p90_s'] * 1e3:6.0f} ms, decode alone {d['decode_s_per_token'] * 1e3:5.2f} ms/token "
              f"(median "
              f"gap in the rounds {d['itl_median_s'] * 1e3:5.1f} ms), "
              f"hits {d['hit_of_ceiling']:.2f} of ceiling")
        print("          hit rate by round " + " ".join(f"{h:.2f}/{c:.2f}" for h, c in
                                                       zip(d["hit_rate_by_round"], d["ceiling_by_round"])))
    print(f"on/off: {json.dumps({k: round(v, 3) for k, v in r.items()})}")
    print(f"bytes moved (all passes) {on['host_tier']['moved_bytes']}; host tier {host_bytes / 1e6:.1f} MB ("
          f"{on['host_tier']['used_tokens']} tokens held), RSS growth over the rounds {rss_growth / 1e6:.1f} MB (tier "
          f"off: {off['rss_growth_bytes'] / 1e6:.1f} MB); forced retraction {out['forced_retraction']}")
    for row in out["disk_against_recompute"]:
        print(f"disk: prompt {row['prompt']:5d}: recompute {row['recompute_s'] * 1e3:7.1f} ms, from disk "
              f"{row['disk_s'] * 1e3:7.1f} ms ({row['from_disk']} tokens read)")
    for name, ok in targets:
        print(f"  [{'x' if ok else ' '}] {name}")
    Path(a.json).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
